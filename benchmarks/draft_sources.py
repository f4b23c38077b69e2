"""Offline estimate: do a GRPO group's sibling responses make better n-gram drafts than the row's
own context alone, for the speculative tail (hybridflow/rollout/speculative.py)?

What it measures. The tail drafts each row's next k tokens with `NgramDrafter`: the tokens that
followed the last earlier occurrence of the row's last n tokens (n = ngram_max down to ngram_min)
in the row's own context (prompt + response so far), continued periodically. In GRPO each prompt
is sampled `n` times; the other rows of the group (siblings) answer the same question, and in the
tail most of them have finished. With point-mass drafts, speculative sampling keeps a draft with
probability p(draft), so the expected number of kept drafts at a position equals the expected
number of leading drafts equal to the tokens a plain sampler produced next. Over real sampled
responses this script therefore counts, at every position of every row, the leading drafts that
equal the row's real continuation, for three drafters:

  own       today's NgramDrafter over the row's own context (the class itself, fed token by token);
  fallback  own first; where own proposes nothing, the same lookup over the siblings' responses;
  longest   the longest n with a match in own context or any sibling (own preferred on a tie,
            then siblings in row order, the last occurrence in each).

Sibling context comes in two variants: `full` (each sibling's whole response, as when siblings
have finished before the tail) and `sync` (each sibling's response only up to the same position,
the conservative one). A sibling match at position c of sibling s drafts s[c], s[c + 1], ... up to
the end of s (no periodic continuation across rows; drafts stop at the sibling's end).

Reported per drafter: tokens per row-step = 1 + mean accepted drafts, mean accepted drafts, and
coverage (the fraction of row-steps with at least one draft), over all positions and over tail
positions (position >= --tail-from in rows longer than --tail-rows-over tokens). Drafts are capped
at the tokens left in the row (the real tail caps them at max_new_tokens).

Samples: real responses of the real model. Without --samples present, it generates them on CPU
(fp32) from the GGUF with `Generator.generate` (plain decoding at --temperature, --n rows per
prompt, prompts chat-templated from the parquet as hybridflow.data does) and saves the token ids.

    bash launch/fetch_qwen_coder.sh && python -m hybridflow.data.prepare gsm8k --out .gsm8k
    python benchmarks/draft_sources.py --prompts 8 --samples /tmp/draft_samples_a.json \\
        --out /tmp/a.json                                    # generates prompts 0-7 (seed 0)
    python benchmarks/draft_sources.py --prompts 8 --first 8 --seed 100 \\
        --samples /tmp/draft_samples_b.json --out /tmp/b.json  # prompts 8-15
    python benchmarks/draft_sources.py --samples /tmp/draft_samples_a.json \\
        /tmp/draft_samples_b.json --out benchmarks/results/draft_sources_cpu.json  # both
    # the committed samples (both parts): benchmarks/results/draft_sources_cpu_samples.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hybridflow.rollout.speculative import NgramDrafter  # noqa: E402

EOS, PAD = 151645, 151643  # <|im_end|>, <|endoftext|> of the Qwen2.5 file


def generate(args) -> dict:
    """Sample args.n responses to each of the first args.prompts prompts; returns the samples."""
    import torch

    from hybridflow.config import RolloutConfig, SpeculativeConfig
    from hybridflow.data import load_tokenizer
    from hybridflow.data.dataset import PromptDataset
    from hybridflow.models.build import build_model
    from hybridflow.models.gguf import gguf_tokenizer_dir, read_gguf
    from hybridflow.models.hf import load_hf_state_dict
    from hybridflow.rollout import Generator
    from tests.hf_models import single_rank_megatron

    torch.set_num_threads(args.threads)
    tok = load_tokenizer(gguf_tokenizer_dir(args.gguf, cache_dir="/tmp/draft_sources_tok"))
    ds = PromptDataset.from_file(args.data, tokenizer=tok, max_prompt_length=256)
    items = [ds[i] for i in range(args.first, args.first + args.prompts)]
    rows, t0 = [], time.time()
    with single_rank_megatron() as ctx:
        cfg, hf_sd = read_gguf(args.gguf)
        model = build_model(cfg, role="actor", ctx=ctx).eval()
        load_hf_state_dict(model, hf_sd, cfg, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        del hf_sd
        gen = Generator(model_cfg=cfg, params=dict(model.named_parameters()), tp_group=None,
                        device=torch.device("cpu"), dtype=torch.float32,
                        true_vocab_size=cfg.vocab_size)
        rcfg = RolloutConfig(n=args.n, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, stop_token_ids=[PAD],
                             speculative=SpeculativeConfig(enable=False))
        for j in range(0, len(items), args.batch_prompts):  # one call per chunk of prompts
            chunk = items[j:j + args.batch_prompts]
            out = gen.generate([it.prompt_ids for it in chunk], cfg=rcfg, eos_id=EOS,
                               pad_id=PAD, seed=args.seed + j)
            resp, mask = out.response_ids.tolist(), out.response_mask.tolist()
            for q, it in enumerate(chunk):  # rows [p0s0, p0s1, ..., p1s0, ...]
                group = [[t for t, m in zip(r, mk) if m] for r, mk in
                         zip(resp[q * args.n:(q + 1) * args.n], mask[q * args.n:(q + 1) * args.n])]
                rows.append({"index": it.index, "prompt_ids": it.prompt_ids, "responses": group})
                print(f"prompt {it.index}: lengths {[len(g) for g in group]} at "
                      f"{time.time() - t0:.0f} s", flush=True)
    return {"model": args.gguf, "data": args.data, "n": args.n,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "seed": args.seed, "generate_s": round(time.time() - t0, 1), "groups": rows}


def seen(d: NgramDrafter, tokens: list, p: int) -> NgramDrafter:
    """The one-context drafter `d` of a sibling's `tokens`, advanced to its first p tokens."""
    d.append(0, tokens[len(d.ctx[0]):p])
    return d


def sibling_draft(sibs: list, key: tuple, n: int, k: int) -> list:
    """The drafts of the first sibling (row order) whose n-gram index has `key`: up to k tokens
    from the continuation of its last occurrence, stopping at the sibling's visible end."""
    for d in sibs:
        c = d.index[0][n].get(key)
        if c is not None:
            return d.ctx[0][c:c + k]
    return []


def lead(drafts: list, truth: list) -> int:
    a = 0
    for d, t in zip(drafts, truth):
        if d != t:
            break
        a += 1
    return a


def analyse(samples: dict, *, k: int, ngram_max: int, ngram_min: int, tail_from: int,
            tail_rows_over: int) -> dict:
    sizes = list(range(ngram_max, ngram_min - 1, -1))
    names = ["own", "fallback_full", "longest_full", "fallback_sync", "longest_sync"]
    acc = {w: {m: [0, 0, 0] for m in names} for w in ("all", "tail")}  # steps, accepted, drafted
    for g in samples["groups"]:
        prompt, resp = g["prompt_ids"], g["responses"]
        for i, r in enumerate(resp):
            others = [s for j, s in enumerate(resp) if j != i and s]
            kw = dict(ngram_max=ngram_max, ngram_min=ngram_min)
            full = [NgramDrafter([s], **kw) for s in others]
            sync = [NgramDrafter([[]], **kw) for _ in others]
            own = NgramDrafter([prompt], ngram_max=ngram_max, ngram_min=ngram_min)
            in_tail_row = len(r) > tail_rows_over
            for p in range(len(r)):  # the row has emitted r[:p]; the step emits from r[p]
                kk = min(k, len(r) - p - 1)  # tokens left after the one the step draws
                truth = r[p:p + kk]
                ctx = own.ctx[0]
                L = len(ctx)
                d_own = own.draft(0, kk)
                sy = [seen(d, t, p) for d, t in zip(sync, others)]  # siblings' first p tokens
                out = {"own": d_own}
                for tag, sibs in (("full", full), ("sync", sy)):
                    fb = d_own
                    if not fb and kk > 0:
                        for n in sizes:
                            if L >= n:
                                fb = sibling_draft(sibs, tuple(ctx[L - n:]), n, kk)
                                if fb:
                                    break
                    out["fallback_" + tag] = fb
                    lg = []
                    for n in sizes:  # own's lookup at this n, else the siblings'
                        if kk <= 0 or L < n:
                            continue
                        key = tuple(ctx[L - n:])
                        c = own.index[0][n].get(key)
                        if c is not None:
                            lg = [ctx[c + j % (L - c)] for j in range(kk)]
                        else:
                            lg = sibling_draft(sibs, key, n, kk)
                        if lg:
                            break
                    out["longest_" + tag] = lg
                wins = ["all"] + (["tail"] if in_tail_row and p >= tail_from else [])
                for m in names:
                    a = lead(out[m], truth)
                    for w in wins:
                        acc[w][m][0] += 1
                        acc[w][m][1] += a
                        acc[w][m][2] += bool(out[m])
                own.append(0, [r[p]])
    table = {}
    for w, per in acc.items():
        table[w] = {}
        for m, (steps, a, drafted) in per.items():
            table[w][m] = {"row_steps": steps,
                           "tokens_per_row_step": round(1 + a / max(steps, 1), 4),
                           "mean_accepted": round(a / max(steps, 1), 4),
                           "coverage": round(drafted / max(steps, 1), 4)}
    return table


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", required=True, nargs="+", help="JSON of sampled token ids "
                    "(read, several files merged; one absent file is written by generating)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gguf", default=os.path.expanduser(
        "~/.cache/hybridflow/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--data", default=".gsm8k/train.parquet")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--first", type=int, default=0, help="first prompt index in --data")
    ap.add_argument("--batch-prompts", type=int, default=8, help="prompts per generate call")
    ap.add_argument("--n", type=int, default=8, help="rows per prompt (the GRPO group)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--ngram-max", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=1)
    ap.add_argument("--tail-from", type=int, default=256)
    ap.add_argument("--tail-rows-over", type=int, default=300)
    args = ap.parse_args()
    if len(args.samples) == 1 and not os.path.isfile(args.samples[0]):
        samples = generate(args)
        with open(args.samples[0], "w") as f:
            json.dump(samples, f)
    else:  # one file or several (their groups together; sampling settings of the first)
        samples = None
        for path in args.samples:
            with open(path) as f:
                part = json.load(f)
            seeds = part["seed"] if isinstance(part["seed"], list) else [part["seed"]]
            if samples is None:
                samples = part
                samples["seed"] = seeds
            else:
                samples["seed"] += seeds
                samples["groups"] += part["groups"]
                samples["generate_s"] = (samples.get("generate_s") or 0) + part["generate_s"]
    t0 = time.time()
    kw = dict(k=args.draft_tokens, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
              tail_from=args.tail_from, tail_rows_over=args.tail_rows_over)
    table = analyse(samples, **kw)
    per_prompt = []  # the spread between groups: each group's own and sibling-drafter rows
    for g in samples["groups"]:
        t = analyse({"groups": [g]}, **kw)
        per_prompt.append({"index": g["index"], **{
            f"{w}_{m}": (t[w][m]["tokens_per_row_step"], t[w][m]["row_steps"])
            for w in ("all", "tail") for m in ("own", "longest_full", "longest_sync")}})
    lengths = [len(r) for g in samples["groups"] for r in g["responses"]]
    res = {"command": " ".join(["python"] + sys.argv),
           "model": samples["model"], "data": samples["data"],
           "sampling": {k: samples[k] for k in ("n", "max_new_tokens", "temperature", "seed")},
           "generate_s": samples.get("generate_s"), "analyse_s": round(time.time() - t0, 1),
           "prompts": len(samples["groups"]), "rows": len(lengths),
           "positions": sum(lengths), "response_lengths": sorted(lengths),
           "rows_at_cap": sum(x >= samples["max_new_tokens"] for x in lengths),
           "drafter": {"draft_tokens": args.draft_tokens, "ngram_max": args.ngram_max,
                       "ngram_min": args.ngram_min},
           "tail": {"from_position": args.tail_from, "rows_longer_than": args.tail_rows_over},
           "table": table,
           "per_prompt_tokens_per_row_step_and_row_steps": per_prompt}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for w in ("all", "tail"):
        print(f"{w}: row_steps {table[w]['own']['row_steps']}")
        for m, v in table[w].items():
            print(f"  {m:14s} tokens/row-step {v['tokens_per_row_step']:.3f}  "
                  f"coverage {v['coverage']:.3f}")


if __name__ == "__main__":
    main()
