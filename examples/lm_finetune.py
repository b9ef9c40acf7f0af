"""Fine-tune a small GPT-2 on private text with the Hugging Face Trainer and watch it leak.

Everything is built offline: the texts are docstrings of the Python standard library, read at run
time from the installed modules (real text that ships with Python), split at random into three
exchangeable pools: a public pool, the private training set (members) and held-out texts
(non-members). A byte-level BPE tokenizer is trained on the public pool, a 2-layer GPT-2 built
from a config is pretrained on it for a few epochs (that checkpoint is also the reference model
of the reference attack), then fine-tuned by a ``transformers.Trainer`` on the members plus 20
secret-sharer canaries ("the secret code is 123456", Carlini et al. 2019) until it over-fits.

A ``privmon.PrivacyMonitor`` attached to the Trainer runs every language-model statistic
(``privmon.queries.LanguageModelQuery``: loss, zlib, Min-K%, Min-K%++, reference; built by
``language_model_queries``, which share each batch's forward pass) on the
members and non-members at each check; the Trainer's console shows one short line per check,
``trainer.state.log_history`` (and any ``report_to`` logger) every figure. At the end the script
prints, for the last check, each statistic's AUC and advantage beside the same statistics
computed text by text with a plain loop (one unpadded text at a time, the papers' formulas),
and the canaries' exposure before and after fine-tuning.

    python examples/lm_finetune.py            # 73 s on 2 CPU cores
    python examples/lm_finetune.py --quick    # a smoke run, seconds
"""

import argparse
import importlib
import inspect
import math
import time
import zlib

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import privmon
from privmon.attacks import canary_exposure, secret_sharer_canaries
from privmon.attacks.language_model import HIGHER_IS_MEMBER, STATISTICS
from privmon.integrations.transformers import attach
from privmon.queries import language_model_queries

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--members", type=int, default=260, help="private training texts")
parser.add_argument("--epochs", type=int, default=30, help="fine-tuning epochs")
parser.add_argument("--pretrain-epochs", type=int, default=4, help="epochs on the public pool")
parser.add_argument("--checks", type=int, default=5, help="privacy checks during fine-tuning")
parser.add_argument("--max-tokens", type=int, default=64, help="tokens kept per text")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--quick", action="store_true", help="tiny settings (a smoke run)")
args = parser.parse_args()
n_candidates = 2000  # canary fills never trained on
if args.quick:
    args.members, args.epochs, args.pretrain_epochs, args.checks = 40, 3, 1, 1
    n_candidates = 200
torch.set_num_threads(2)
transformers.logging.set_verbosity_error()
start = time.perf_counter()

# -- the corpus: standard-library docstrings, read from the installed modules -------------------
MODULES = (
    "argparse ast base64 bisect calendar codecs collections configparser contextlib copy csv "
    "dataclasses datetime decimal difflib email.message email.utils enum fnmatch fractions "
    "ftplib functools getopt gettext glob gzip hashlib heapq hmac html http.client "
    "http.cookiejar imaplib inspect io ipaddress itertools json locale logging logging.handlers "
    "mailbox mimetypes operator optparse os pathlib pickle pprint queue random re sched secrets "
    "selectors shlex shutil smtplib socket sqlite3 statistics string struct subprocess tarfile "
    "tempfile textwrap threading tokenize traceback types typing unittest.case urllib.parse "
    "urllib.request uuid warnings weakref xml.dom.minidom zipfile"
).split()


def docstrings() -> list[str]:
    """Distinct docstrings of 120-600 characters of the functions, classes and methods each
    module defines, in a fixed order."""
    seen: dict[str, None] = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            members = [obj]
            if inspect.isclass(obj):
                members += [m for _, m in sorted(vars(obj).items()) if inspect.isfunction(m)]
            elif not inspect.isfunction(obj):
                continue
            for m in members:
                doc = inspect.getdoc(m)
                if doc and 120 <= len(doc) <= 600:
                    seen.setdefault(doc)
    return list(seen)


texts = docstrings()
order = np.random.default_rng(args.seed).permutation(len(texts))
n = args.members
members = [texts[i] for i in order[:n]]
nonmembers = [texts[i] for i in order[n : 2 * n]]
public = [texts[i] for i in order[2 * n :]][: 200 if args.quick else None]

# -- tokenizer and model, built offline ---------------------------------------------------------
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
bpe.decoder = decoders.ByteLevel()
bpe.train_from_iterator(
    public,
    trainer=trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ),
)
tokenizer = transformers.PreTrainedTokenizerFast(
    tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
)
torch.manual_seed(args.seed)
config = transformers.GPT2Config(
    vocab_size=len(tokenizer),
    n_positions=args.max_tokens,
    n_embd=64,
    n_layer=2,
    n_head=4,
    bos_token_id=tokenizer.eos_token_id,
    eos_token_id=tokenizer.eos_token_id,
    pad_token_id=tokenizer.pad_token_id,
)
model = transformers.GPT2LMHeadModel(config)
collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)


def encode(items: list[str]) -> list[dict]:
    return [tokenizer(t, truncation=True, max_length=args.max_tokens) for t in items]


def train(dataset: list[dict], epochs: int, **extra) -> transformers.Trainer:
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            output_dir="/tmp/privmon-lm-finetune",
            num_train_epochs=epochs,
            per_device_train_batch_size=16,
            learning_rate=2e-3,
            warmup_steps=20,
            weight_decay=0.0,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,  # log lines on the console, no progress bar
            seed=args.seed,
            **extra,
        ),
        train_dataset=dataset,
        data_collator=collator,
    )
    return trainer


# -- pretraining on the public pool: the reference model ----------------------------------------
train(encode(public), args.pretrain_epochs, logging_strategy="no").train()
reference = transformers.GPT2LMHeadModel(config)
reference.load_state_dict(model.state_dict())
reference.eval()
canaries = secret_sharer_canaries(
    "the secret code is {secret}", n_canaries=20, n_candidates=n_candidates, seed=args.seed
)
model.eval()
exposure_before = {
    m: canary_exposure(model, tokenizer, canaries, method=m) for m in ("rank", "gaussian")
}

# -- fine-tuning on the members and the canaries, with the monitor attached ----------------------
tokenizer.padding_side = "right"


def audit_batches(items: list[str]) -> list[dict]:
    """Fixed collated batches of 32 texts (the monitor's audit sets)."""
    return [collator(encode(items[i : i + 32])) for i in range(0, len(items), 32)]


# one query per statistic, sharing each batch's forward pass
queries = language_model_queries(model, STATISTICS, tokenizer=tokenizer, reference=reference)
train_set = encode(members + canaries.texts)
steps = args.epochs * math.ceil(len(train_set) / 16)
monitor = privmon.PrivacyMonitor(
    queries,
    audit_batches(members),
    audit_batches(nonmembers),
    every_n_steps=max(1, steps // args.checks),
    planned_checks=args.checks,
)
trainer = train(train_set, args.epochs, logging_steps=max(1, steps // args.checks))
attach(trainer, monitor)  # console="headline": one short line per check
trainer.train()
model.eval()
exposure_after = {
    m: canary_exposure(model, tokenizer, canaries, method=m) for m in ("rank", "gaussian")
}
report = monitor.last_report
assert report is not None


# -- the same statistics text by text, by hand ----------------------------------------------------
@torch.no_grad()
def by_hand(net: torch.nn.Module, text: str) -> tuple[float, list[float], list[float]]:
    """Loss, token log-probabilities and Min-K%++ z-scores of one unpadded text."""
    ids = torch.tensor([tokenizer(text, truncation=True, max_length=args.max_tokens)["input_ids"]])
    logp = torch.log_softmax(net(ids).logits[0, :-1].double(), dim=-1)
    target = logp.gather(1, ids[0, 1:, None])[:, 0]
    p = logp.exp()
    mu = (p * logp).sum(-1)
    sigma = ((p * logp**2).sum(-1) - mu**2).sqrt()
    return -float(target.mean()), target.tolist(), ((target - mu) / sigma).tolist()


def lowest(values: list[float], k: float = 0.2) -> float:
    kept = sorted(values)[: int(len(values) * k)]
    return sum(kept) / len(kept) if kept else math.nan


def statistics_by_hand(items: list[str]) -> dict[str, np.ndarray]:
    out: dict[str, list[float]] = {s: [] for s in STATISTICS}
    for text in items:
        loss, lps, zs = by_hand(model, text)
        decoded = tokenizer.decode(
            tokenizer(text, truncation=True, max_length=args.max_tokens)["input_ids"],
            skip_special_tokens=True,
        )
        out["loss"].append(loss)
        out["zlib"].append(loss / len(zlib.compress(decoded.encode("utf-8"))))
        out["min_k"].append(lowest(lps))
        out["min_k_plus_plus"].append(lowest(zs))
        out["reference"].append(loss - by_hand(reference, text)[0])
    return {s: np.array(v) for s, v in out.items()}


hand_in, hand_out = statistics_by_hand(members), statistics_by_hand(nonmembers)
elapsed = time.perf_counter() - start

print()
print(
    f"{len(texts)} stdlib docstrings: {n} members, {n} non-members, {len(public)} public; "
    f"GPT-2 {config.n_layer} layers x {config.n_embd}, vocabulary {len(tokenizer)}; "
    f"{args.epochs} epochs, {trainer.state.global_step} steps; {elapsed:.0f}s in all, of which "
    f"{sum(r.seconds for r in monitor.history):.0f}s in {len(monitor.history)} privacy checks"
)
print()
print(
    f"Last check (step {report.step}): the monitor's figures (histogram method) beside the same "
    "statistics computed by a per-text loop"
)
print()
print("| statistic | AUC | AUC by hand | advantage [certified lower] | advantage by hand |")
print("|---|---:|---:|---:|---:|")
for s in STATISTICS:
    q = report.scalars
    orient = 1 if HIGHER_IS_MEMBER[s] else -1
    a, b = hand_in[s], hand_out[s]
    a, b = a[np.isfinite(a)], b[np.isfinite(b)]
    auc = privmon.auc(orient * a, orient * b)
    adv = privmon.optimal_advantage(a, b, method="histogram").value
    print(
        f"| {s} | {q[f'privacy/{s}/auc']:.3f} | {auc:.3f} | "
        f"{q[f'privacy/{s}/histogram/value']:.3f} [{q[f'privacy/{s}/histogram/lower']:.3f}] | "
        f"{adv:.3f} |"
    )
print()
print(
    f"Secret-sharer canaries (20, six digits: |R| = 10^6; {n_candidates} candidate fills), in bits:"
)
print("| exposure | mean | max |")
print("|---|---:|---:|")
top = f"at most {math.log2(n_candidates + 1):.1f}"
rows = {
    f"before fine-tuning, rank among the candidates ({top})": exposure_before["rank"],
    "before fine-tuning, Gaussian fit": exposure_before["gaussian"],
    f"after, rank among the candidates ({top})": exposure_after["rank"],
    f"after, Gaussian fit (at most {math.log2(10**6):.1f})": exposure_after["gaussian"],
}
for label, bits in rows.items():
    print(f"| {label} | {np.mean(bits):.1f} | {np.max(bits):.1f} |")
