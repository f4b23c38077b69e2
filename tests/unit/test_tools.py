"""Tools: the sandboxed code interpreter's limits (each ends as error text, never an exception),
the calculator, and tool-config parsing errors that name the file and the key."""

import asyncio
import os

import pytest

from hybridflow.tools import ToolCall, load_tool_config, register_tool
from hybridflow.tools.calculator import evaluate
from hybridflow.tools.code import CodeInterpreter, run_python, truncate_middle

SCHEMA = {"type": "function", "function": {"name": "code_interpreter", "description": "python",
                                           "parameters": {"type": "object", "properties": {}}}}


def interp(**kw):
    return CodeInterpreter(name="code_interpreter", schema=SCHEMA, **kw)


def test_code_runs_and_files_stay_in_its_directory():
    out = interp().run(ToolCall("code_interpreter", {"code": (
        "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), 6 * 7)")}))
    assert not out.error and out.text == "hi 42\n"


@pytest.mark.parametrize("code, expect, timeout", [
    ("while True:\n    pass", "TimeoutError", True),
    ("x = bytearray(8 * 1024 ** 3)", "MemoryError", False),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
     "socket", False),
    ("import os\nos.system('echo hi > /tmp/x')", "os.system is not allowed", False),
    ("import subprocess\nsubprocess.run(['true'])", "subprocess.Popen is not allowed", False),
    ("open('/tmp/hf_sandbox_escape', 'w').write('x')", "only files in the working directory",
     False),
    ("import os\nos.remove(os.path.expanduser('/etc/hostname'))", "outside the working", False),
    ("1 / 0", "ZeroDivisionError", False),
    ("import resource\nresource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
     "not allowed to raise maximum limit", False),
], ids=["infinite_loop", "memory_bomb", "network", "os_system", "subprocess", "write_outside",
        "remove_outside", "exception", "raise_limits"])
def test_sandbox_limits_end_as_error_text(code, expect, timeout):
    out = interp(timeout_s=4, cpu_s=2, memory_mb=512).run(
        ToolCall("code_interpreter", {"code": code}))
    assert out.error and out.timeout == timeout
    assert out.text.startswith("Error") and expect in out.text, out.text
    assert not os.path.exists("/tmp/hf_sandbox_escape")


def test_output_is_truncated():
    text, status = run_python("print('x' * 50000)", max_output_chars=300)
    assert status == "ok" and len(text) <= 300 and "truncated" in text
    assert truncate_middle("abc", 10) == "abc"


def test_calculator():
    assert evaluate("3 * (4 + 5) - 2 ** 3") == 19
    assert evaluate("sqrt(16) + abs(-2)") == 6.0
    for bad in ("__import__('os')", "2 ** 100000", "x + 1", "(1).real"):
        with pytest.raises(ValueError):
            evaluate(bad)
    tools = load_tool_config_text("""
tools:
  - class_name: calculator
    tool_schema: {type: function, function: {name: calc, description: d,
                  parameters: {type: object, properties: {expression: {type: string}}}}}
""")
    assert tools[0].run(ToolCall("calc", {"expression": "10 / 4"})).text == "2.5"
    out = tools[0].run(ToolCall("calc", {"expression": "open('x')"}))
    assert out.error and "unsupported" in out.text


_TMP = {}


def load_tool_config_text(text, tmp=None):
    import tempfile

    d = tempfile.mkdtemp()
    path = os.path.join(d, "tools.yaml")
    with open(path, "w") as f:
        f.write(text)
    _TMP["path"] = path
    return load_tool_config(path)


@pytest.mark.parametrize("text, key", [
    ("tool: []", "top-level key 'tools'"),
    ("tools:\n  - config: {}\n", "tools[0].class_name"),
    ("tools:\n  - class_name: nope.Missing\n    tool_schema: {type: function, function: {name: a}}\n",
     "tools[0].class_name"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {function: {name: a}}\n",
     "tools[0].tool_schema"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {}}\n",
     "tools[0].tool_schema.function.name"),
    ("tools:\n  - class_name: calculator\n    config: {bogus: 1}\n"
     "    tool_schema: {type: function, function: {name: a}}\n", "tools[0].config"),
    ("tools:\n  - class_name: calculator\n    tool_schema: {type: function, function: {name: a}}\n"
     "  - class_name: calculator\n    tool_schema: {type: function, function: {name: a}}\n",
     "tools[1].tool_schema.function.name"),
    ("tools: [", "not valid YAML"),
], ids=["no_tools", "no_class", "bad_class", "bad_schema", "no_name", "bad_config", "duplicate",
        "yaml"])
def test_tool_config_errors_name_file_and_key(text, key):
    with pytest.raises(ValueError) as e:
        load_tool_config_text(text)
    assert _TMP["path"] in str(e.value) and key in str(e.value)


def test_function_tools_and_missing_file():
    @register_tool("test_echo_upper")
    def echo(text: str) -> str:
        return text.upper()

    tools = load_tool_config_text("""
tools:
  - class_name: test_echo_upper
    tool_schema: {type: function, function: {name: echo, parameters: {type: object}}}
""")
    assert tools[0].run(ToolCall("echo", {"text": "hi"})).text == "HI"
    out = tools[0].run(ToolCall("echo", {"wrong": 1}))  # a bad call is text for the model
    assert out.error and "TypeError" in out.text
    with pytest.raises(ValueError, match="rollout.multi_turn.tool_config_path"):
        load_tool_config("/nonexistent/tools.yaml")
    assert asyncio.run(tools[0].execute({"text": "a"})) == "A"


def test_multi_turn_config_checks():
    from hybridflow.config import MultiTurnConfig, RolloutConfig
    from hybridflow.config_checks import validate_multi_turn

    on = dict(enable=True, tool_config_path="tools.yaml")
    validate_multi_turn(RolloutConfig(multi_turn=MultiTurnConfig(**on)))
    # its decode step is CUDA-graphed with KV windows and compaction
    validate_multi_turn(RolloutConfig(multi_turn=MultiTurnConfig(**on), cuda_graphs=True,
                                      decode_kv_window=64, compact_finished_rows=True))
    validate_multi_turn(RolloutConfig(multi_turn=MultiTurnConfig(enable=False, format="bogus")))
    # results appended at once, or held without a step bound
    validate_multi_turn(RolloutConfig(multi_turn=MultiTurnConfig(
        **on, append_wait_steps=0, append_batch_rows=1)))
    validate_multi_turn(RolloutConfig(multi_turn=MultiTurnConfig(**on, append_wait_steps=10**6)))
    # the multi-turn step runs the single-turn step's Triton layers too
    validate_multi_turn(RolloutConfig(multi_turn=MultiTurnConfig(**on), decode_kernels="triton"))
    for key, bad in (("append_wait_steps", -1), ("append_wait_steps", 2.5),
                     ("append_wait_steps", True), ("append_batch_rows", 0),
                     ("append_batch_rows", "8")):
        with pytest.raises(ValueError, match=rf"rollout\.multi_turn\.{key}=.* must be an integer"):
            validate_multi_turn(RolloutConfig(multi_turn=MultiTurnConfig(**on, **{key: bad})))
    for r, key in [(RolloutConfig(multi_turn=MultiTurnConfig(enable=True)), "tool_config_path"),
                   (RolloutConfig(multi_turn=MultiTurnConfig(**on, format="json")),
                    "rollout.multi_turn.format"),
                   (RolloutConfig(multi_turn=MultiTurnConfig(**on), compile_decode=True),
                    "rollout.compile_decode"),
                   (RolloutConfig(multi_turn=MultiTurnConfig(**on), quantization="fp8"),
                    "rollout.quantization"),
                   ]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            validate_multi_turn(r)


def test_tools_recipe_uses_the_code_format_and_the_probed_prompt():
    """The tools experiment runs the format the model was seen to write, with the system prompt
    benchmarks/tool_format_probe.py measured (docs/recipes.md)."""
    from benchmarks.tool_format_probe import CODE_STRICT
    from hybridflow.config import load_config
    from hybridflow.config_checks import validate_multi_turn

    cfg = load_config(["experiment=gsm8k_tools_qwen_coder_0_5b"])
    assert cfg.rollout.multi_turn.format == "code" and cfg.data.system_prompt == CODE_STRICT
    validate_multi_turn(cfg.rollout)
