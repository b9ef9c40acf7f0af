"""Peak memory of the language-model statistics beside the model's own forward pass.

A GPT-2-shaped model built from a config (vocabulary 50,257, 1,024 positions; 2 layers of width
128 by default, so that it runs on a laptop CPU) scores a batch of 1,024-token texts. For each
step the table gives the peak resident memory added by that step alone, in MiB:

* ``forward``: ``model(input_ids)``, which holds the (n, T, V) float32 logits;
* ``min_k_plus_plus`` / ``min_k`` / ``loss``: :func:`privmon.attacks.lm_statistic` on those
  logits (chunked over the sequence, ``chunk_tokens`` positions at a time);
* ``min_k_plus_plus (whole)``: the same statistic computed without chunks, as a per-text
  implementation does it (log-softmax, probabilities and their products over the whole
  (n, T, V) block): what the chunking saves.

Method: every step runs in a fresh child process started with ``MALLOC_MMAP_THRESHOLD_=65536``,
so that glibc serves every large block with mmap and gives it back on free (resident memory then
follows what is allocated); the child builds the model and the inputs (and the logits for the
statistics), resets the kernel's peak-RSS mark (``echo 5 > /proc/self/clear_refs``), runs the
step (after one warm-up call on 8 positions: a first call sets up a few MiB of library state
once) and reports ``VmHWM`` after it − ``VmRSS`` before it, from ``/proc/self/status``. Linux
only.
The bound the module states, 2 · chunk_tokens · V · 4 bytes for float32 logits (31.8 MiB with the
default chunk of 83 positions), is printed beside it.

    python benchmarks/lm_memory.py                 # batch 1 and 4, default chunk (~4 minutes)
    python benchmarks/lm_memory.py --batch 2 --chunk-tokens 256
    python benchmarks/lm_memory.py --vocab 262144 --tokens 64 --batch 2 --steps min_k_plus_plus

The last is issue #31's case (a vocabulary of 262,144, float32 logits (2, 64, V) of 128 MiB;
``tests/attacks/test_reliability_lm.py`` asserts its bound): Min-K%++ adds 31.8-32.0 MiB at peak,
the bound 2 · ⌊2²²/V⌋ · V · 4 bytes = 32.0 MiB (chunks of 16 positions); with ``--chunk-tokens 128``
(a chunk constant of 2²⁵, the mutant the test kills) it adds 255.9 MiB, and the whole-block
computation 503.9 MiB (2 cores, glibc 2.36, torch 2.13 CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

STEPS = ("forward", "loss", "min_k", "min_k_plus_plus", "min_k_plus_plus (whole)")


def _status(key: str) -> int:
    """A /proc/self/status figure in KiB."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def whole_min_k_plus_plus(logits, ids, k: float = 0.2):
    """Min-K%++ over the whole (n, T, V) block at once, no chunks (as a per-text loop does)."""
    import torch

    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    p = logp.exp()
    mu = (p * logp).sum(-1)
    sigma = ((p * logp.square()).sum(-1) - mu.square()).sqrt()
    z = (logp.gather(-1, ids[:, 1:, None])[..., 0] - mu) / sigma
    return z.sort(dim=1).values[:, : int(k * z.shape[1])].mean(dim=1)


def measure(step: str, *, vocab: int, tokens: int, batch: int, chunk_tokens: int | None) -> dict:
    """Run one step in this process; its peak added memory (MiB) and seconds."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from privmon.attacks import lm_statistic

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=vocab, n_positions=tokens, n_embd=128, n_layer=2, n_head=4, use_cache=False
    )
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, vocab, (batch, tokens))

    def run(ids, logits):
        if step == "forward":
            return model(ids).logits
        if step == "min_k_plus_plus (whole)":
            return whole_min_k_plus_plus(logits, ids)
        return lm_statistic(logits, ids, statistic=step, chunk_tokens=chunk_tokens)

    with torch.no_grad():
        logits = model(ids).logits if step != "forward" else None
        # a first call sets up library state once (a few MiB): warm up on 8 positions
        run(ids[:, :8], None if logits is None else logits[:, :8])
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS mark to the current RSS
        before = _status("VmRSS")
        t0 = time.perf_counter()
        out = run(ids, logits)
        seconds = time.perf_counter() - t0
        peak = _status("VmHWM")
        del out
    return {"mib": (peak - before) / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--steps", choices=STEPS, nargs="+", default=list(STEPS))
    parser.add_argument("--measure", choices=STEPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:  # a child: one step, one JSON line
        result = measure(
            args.measure,
            vocab=args.vocab,
            tokens=args.tokens,
            batch=args.batch[0],
            chunk_tokens=args.chunk_tokens,
        )
        print(json.dumps(result))
        return
    chunk = args.chunk_tokens or max(1, 2**22 // args.vocab)
    bound = 2 * chunk * args.vocab * 4 / 2**20
    print(
        f"V = {args.vocab}, T = {args.tokens}, chunk_tokens = {chunk}: stated bound of the "
        f"chunked statistics' extra memory {bound:.1f} MiB (float32 logits)\n"
    )
    print("| batch | step | peak added (MiB) | logits (MiB) | seconds |")
    print("|---:|---|---:|---:|---:|")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    for batch in args.batch:
        logits_mib = batch * args.tokens * args.vocab * 4 / 2**20
        for step in args.steps:
            cmd = [sys.executable, __file__, "--measure", step, "--batch", str(batch)]
            cmd += ["--vocab", str(args.vocab), "--tokens", str(args.tokens)]
            if args.chunk_tokens:
                cmd += ["--chunk-tokens", str(args.chunk_tokens)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {batch} | {step} | {r['mib']:.1f} | {logits_mib:.1f} | {r['seconds']:.2f} |")


if __name__ == "__main__":
    main()
