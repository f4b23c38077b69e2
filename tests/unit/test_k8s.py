"""The Kubernetes manifests of launch/k8s/ (docs/kubernetes.md).

Every YAML document there is deserialized into the official `kubernetes` client's model of its kind
(types checked), and walked against the models' `attribute_map` / `openapi_types` so that a key the
API does not have (a typo such as `backofLimit`) fails: the client's deserializer drops unknown keys
silently. Then what the docs promise: GPUs, the volume and the output dir on it, retries and TTL,
the indexed job's c10d rendezvous, and the Hydra overrides, which must load (and validate at the
job's world size) against our config schema.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import pytest
import yaml

kubernetes = pytest.importorskip("kubernetes")
from kubernetes.client import ApiClient, models  # noqa: E402

K8S = Path(__file__).resolve().parents[2] / "launch" / "k8s"
MODEL_OF = {("batch/v1", "Job"): "V1Job", ("v1", "Service"): "V1Service",
            ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim"}


def _documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


DOCS = _documents()


def _deserialize(doc: dict, model: str):
    return ApiClient()._ApiClient__deserialize(doc, model)


def unknown_keys(data, type_name: str, where: str = "") -> list[str]:
    """Paths of the keys in `data` that the client's model `type_name` (nested models included)
    does not have. Type names as the client writes them: V1Job, List[X] / list[X], Dict[str, X] /
    dict(str, X), Optional[X]; primitives and `object` (int-or-string) are the deserializer's."""
    if m := re.fullmatch(r"Optional\[(.+)\]", type_name):
        return unknown_keys(data, m[1], where)
    if m := re.fullmatch(r"[Ll]ist\[(.+)\]", type_name):
        return [k for i, x in enumerate(data or []) for k in unknown_keys(x, m[1], f"{where}[{i}]")]
    if m := re.fullmatch(r"Dict\[[^,]+, (.+)\]|dict\([^,]+, (.+)\)", type_name):
        value_type = m[1] or m[2]
        return [k for key, x in (data or {}).items()
                for k in unknown_keys(x, value_type, f"{where}.{key}")]
    cls = getattr(models, type_name, None)
    if cls is None or not isinstance(data, dict):
        return []
    attr_of = {json_key: attr for attr, json_key in cls.attribute_map.items()}
    bad = []
    for key, value in data.items():
        if key not in attr_of:
            bad.append(f"{where}.{key} (not in {type_name})")
        else:
            bad += unknown_keys(value, cls.openapi_types[attr_of[key]], f"{where}.{key}")
    return bad


@pytest.mark.parametrize("name,doc", DOCS, ids=[f"{n}:{d.get('kind')}" for n, d in DOCS])
def test_document_is_a_valid_object_of_its_kind(name, doc):
    key = (doc.get("apiVersion"), doc.get("kind"))
    assert key in MODEL_OF, f"{name}: unexpected apiVersion/kind {key}"
    model = MODEL_OF[key]
    obj = _deserialize(doc, model)
    assert type(obj).__name__ == model and obj.metadata.name
    assert unknown_keys(doc, model) == [], f"{name}: keys the Kubernetes API does not have"


def test_strict_walk_catches_what_the_client_drops():
    doc = copy.deepcopy(next(d for n, d in DOCS if n == "job.yaml" and d["kind"] == "Job"))
    doc["spec"]["backofLimit"] = 3
    doc["spec"]["template"]["spec"]["containers"][0]["resource"] = {}
    _deserialize(doc, "V1Job")  # accepted: the client ignores unknown keys
    assert sorted(unknown_keys(doc, "V1Job")) == [
        ".spec.backofLimit (not in V1JobSpec)",
        ".spec.template.spec.containers[0].resource (not in V1Container)"]


def _objects(filename: str) -> dict[str, object]:
    found = [d for n, d in DOCS if n == filename]
    return {d["kind"]: _deserialize(d, MODEL_OF[(d["apiVersion"], d["kind"])]) for d in found}


def _env(container) -> dict[str, str]:
    return {e.name: e.value for e in container.env or []}


def _claims() -> set[str]:
    return {d["metadata"]["name"] for _, d in DOCS if d["kind"] == "PersistentVolumeClaim"}


JOB_FILES = ["job.yaml", "multinode-job.yaml"]


@pytest.mark.parametrize("filename", JOB_FILES)
def test_job_frees_gpus_retries_and_resumes_on_the_volume(filename):
    job = _objects(filename)["Job"]
    spec, pod = job.spec, job.spec.template.spec
    assert spec.backoff_limit and spec.backoff_limit >= 1
    assert spec.ttl_seconds_after_finished is not None and spec.ttl_seconds_after_finished > 0
    assert spec.active_deadline_seconds is None  # optional: left commented out
    assert pod.restart_policy == "Never"  # podFailurePolicy requires it
    (train,) = pod.containers
    env = _env(train)
    gpus = train.resources.limits["nvidia.com/gpu"]
    assert int(gpus) >= 1 and env["GPUS"] == gpus, "GPUS must equal the nvidia.com/gpu limit"

    volumes = {v.name: v for v in pod.volumes}
    mounts = {m.mount_path: m.name for m in train.volume_mounts}
    assert volumes[mounts["/dev/shm"]].empty_dir.medium == "Memory"
    pvc_mounts = [p for p, v in mounts.items() if volumes[v].persistent_volume_claim is not None]
    assert len(pvc_mounts) == 1
    claim = volumes[mounts[pvc_mounts[0]]].persistent_volume_claim.claim_name
    assert claim in _claims(), f"{filename}: claim {claim} is defined in no manifest of launch/k8s"

    overrides = dict(a.split("=", 1) for a in train.args)
    out = overrides["trainer.output_dir"]
    assert Path(out).is_relative_to(pvc_mounts[0]), f"output dir {out} is not on the volume"
    assert overrides.get("trainer.resume", "true") == "true"
    for value in overrides.values():  # every file the run reads or writes lives on the volume
        if value.startswith("/"):
            assert Path(value).is_relative_to(pvc_mounts[0]), value


def test_single_node_job_runs_standalone_torchrun():
    train = _objects("job.yaml")["Job"].spec.template.spec.containers[0]
    assert train.command == ["torchrun", "--standalone", "--nproc_per_node=$(GPUS)",
                             "-m", "hybridflow.train"]


def _flags(script: str) -> dict[str, str]:
    return dict(re.findall(r"--(\w+)=(\S+)", script))


def test_multinode_job_is_indexed_with_c10d_rendezvous_on_pod_0():
    objs = _objects("multinode-job.yaml")
    job, svc = objs["Job"], objs["Service"]
    spec, pod = job.spec, job.spec.template.spec
    train = pod.containers[0]
    env = _env(train)
    assert spec.completion_mode == "Indexed"
    assert spec.completions == spec.parallelism == int(env["NNODES"]) >= 2

    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    assert pod.subdomain == svc.metadata.name
    assert svc.spec.selector.items() <= job.spec.template.metadata.labels.items()

    assert train.command[:2] == ["bash", "-c"] and len(train.command) == 4
    script = train.command[2]
    assert script.rstrip().endswith('-m hybridflow.train "$@"')  # `args` are the overrides
    flags = _flags(script)
    assert flags["rdzv_backend"] == "c10d"
    host, port = flags["rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{job.metadata.name}-0.{svc.metadata.name}"
    assert re.search(r"^\s*HEAD=(\S+)$", script, re.M)[1] == host  # the name it waits for
    assert int(port) in {p.port for p in svc.spec.ports}
    assert flags["node_rank"] == "$JOB_COMPLETION_INDEX"
    assert flags["nnodes"] == "$NNODES" and flags["nproc_per_node"] == "$GPUS"
    for name in ("NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_NVLS_ENABLE",
                 "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_DEVICE_MAX_CONNECTIONS"):
        assert name in env, name


@pytest.mark.parametrize("filename", JOB_FILES)
def test_overrides_load_and_validate_at_the_jobs_world_size(filename):
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate

    job = _objects(filename)["Job"]
    train = job.spec.template.spec.containers[0]
    env = _env(train)
    world = int(env["GPUS"]) * int(env.get("NNODES", "1"))
    cfg = load_config(list(train.args))  # a renamed or mistyped key raises ValueError here
    validate(cfg, world_size=world)
    assert cfg.trainer.output_dir == dict(a.split("=", 1) for a in train.args)["trainer.output_dir"]


def _scripts(pod) -> list[str]:
    """The `bash -c` scripts of a pod's containers (the script is in `command` or in `args`)."""
    scripts = []
    for c in (pod.init_containers or []) + pod.containers:
        if c.command[:2] == ["bash", "-c"]:
            scripts.append(c.command[2] if len(c.command) > 2 else c.args[0])
    return scripts


@pytest.mark.parametrize("filename", JOB_FILES)
def test_scripts_parse_and_fetch_what_the_overrides_read(filename):
    pod = _objects(filename)["Job"].spec.template.spec
    for script in _scripts(pod):
        subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    (fetch,) = pod.init_containers
    fetch_script = fetch.args[0]
    overrides = dict(a.split("=", 1) for a in pod.containers[0].args)
    gguf = Path(overrides["model.gguf_path"])
    fetcher = (K8S.parents[0] / "fetch_qwen_coder.sh").read_text()
    assert gguf.name == re.search(r'NAME="\$\{QWEN_GGUF_NAME:-([^}]+)\}"', fetcher)[1]
    assert f"launch/fetch_qwen_coder.sh {gguf.parent}" in fetch_script
    for key in ("data.train_files", "data.val_files"):
        path = Path(overrides[key])
        assert str(path.parent) in fetch_script and path.name in fetch_script, key
