#!/usr/bin/env python
"""Train asyncengine's bundled default model: a tiny Llama that completes Python code.

Why this model exists: the engine needs a real (not random) model that every machine can load
offline, so that `asyncengine generate "def fibonacci(n):"` prints something meaningful and the
tests can compare the engine's greedy output against HF transformers on non-degenerate logits.

Corpus
    The ``*.py`` files of the running interpreter's standard library
    (``sysconfig.get_paths()["stdlib"]``), walked in sorted order. Excluded: anything under a
    ``test``/``tests``/``idle_test`` directory (``test/``, ``idlelib/idle_test``, ``lib2to3/tests``,
    ``ctypes/test``, ...), ``site-packages``, and two packages that are data rather than code:
    ``encodings`` (charmap tables) and ``pydoc_data`` (one 750 kB string literal). A file is held
    out for validation iff ``sha256(relative_posix_path) % 50 == 0`` (about 2 % of the files);
    hashing the path instead of indexing keeps the split stable when another Python version adds
    or removes files.

Tokenizer
    Byte-level BPE trained with ``tokenizers`` on the training files only (vocab 4096, special
    tokens ``<|endoftext|>`` = bos = eos = pad, ``<|im_start|>``, ``<|im_end|>``), wrapped as a
    ``PreTrainedTokenizerFast`` with a ChatML chat template stored in ``tokenizer_config.json``.
    No BOS is prepended on encode (as for GPT-2/Qwen): training windows start at arbitrary
    offsets, so the model does not rely on one. The chat tokens are never seen in training; the
    template exists so that chat endpoints have something to render.

Model and training
    ``LlamaForCausalLM`` from scratch (see ``ModelHParams``/``TrainHParams`` for the values),
    plain PyTorch AdamW, linear warm-up then cosine decay, next-token cross-entropy on windows of
    ``seq_len + 1`` tokens cut from the concatenated training stream (files joined by
    ``<|endoftext|>``), window order drawn from a seeded ``torch.Generator``. Weights are saved in
    float32 (about 16 MB) so the HF reference and the engine see identical values.

Determinism: the corpus walk, split, tokenizer and data order depend only on ``--seed`` and the
stdlib's contents; float results also depend on ``--threads`` (reduction order), so the shipped
numbers are for ``--threads 1``.

Usage::

    python tools/train_default_model.py                 # full run into asyncengine/assets/default-model
    python tools/train_default_model.py --quick --out /tmp/m   # smoke test, well under a minute

Outputs in ``--out``: ``config.json``, ``generation_config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` (if transformers writes
one), ``training_log.json``, ``loss_curve.png`` and ``README.md`` (the model card).

The functions ``corpus_files``, ``split_corpus``, ``heldout_eval_windows`` and ``heldout_loss``
are imported by the test suite, so importing this module has no side effects.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "asyncengine" / "assets" / "default-model"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS, IM_START, IM_END)  # ids 0, 1, 2 in this order

# Directory names (any path component) whose files are not training text.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings", "pydoc_data"}
)
HELDOUT_MODULUS = 50  # 1 file in 50, i.e. ~2 %, is held out

# The held-out slice the test suite recomputes: small so that the test runs in seconds.
TEST_SLICE_WINDOWS = 8
TEST_SLICE_SEQ_LEN = 256

# ChatML; with `tools`, Hermes / Qwen2.5's tool format: the definitions in a system message's <tools>
# block (after the chat's own system message, if any), an assistant's calls as <tool_call> JSON, tool
# results as <tool_response>; so a server's "hermes" tool-call parser reads the model's calls. A chat
# without tools or tool messages renders exactly as plain ChatML.
TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOLS_POSTSCRIPT = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '" + TOOLS_PREAMBLE + "' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '" + TOOLS_POSTSCRIPT + "' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}{{ '\\n' + message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] if call['function'] is defined "
    "else call %}{{ '\\n<tool_call>\\n' }}{{ {'name': f['name'], 'arguments': f['arguments']} | tojson }}"
    "{{ '\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SAMPLE_PROMPTS = ("def fibonacci(n):", "import os\n", "class Stack:\n", "    for i in range(")


@dataclasses.dataclass(frozen=True)
class ModelHParams:
    """Architecture of the default model (a `transformers.LlamaConfig` subset)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


@dataclasses.dataclass(frozen=True)
class TrainHParams:
    """Optimisation settings; `steps` x `batch_size` x `seq_len` tokens are seen in total."""

    steps: int = 1100
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 64  # held-out windows for the periodic evaluation (the curve)
    log_every: int = 10


QUICK_MODEL = ModelHParams(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=172,
    max_position_embeddings=256,
)
QUICK_TRAIN = TrainHParams(
    steps=30,
    batch_size=4,
    seq_len=64,
    lr=3e-3,
    warmup_steps=5,
    eval_every=10,
    eval_windows=4,
    log_every=5,
)
QUICK_FILES = 40  # training files used by --quick


# ----------------------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[str]:
    """Sorted relative POSIX paths of the stdlib ``.py`` files used as corpus (train + held-out)."""
    root = stdlib_root() if root is None else root
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel_path: str) -> bool:
    """Whether a corpus file belongs to the validation set (a hash of its path, not its index)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELDOUT_MODULUS == 0


def split_corpus(files: Sequence[str]) -> tuple[list[str], list[str]]:
    """(train, held-out) file lists, both in the input (sorted) order."""
    train = [f for f in files if not is_heldout(f)]
    heldout = [f for f in files if is_heldout(f)]
    return train, heldout


def read_source(rel_path: str, root: Path | None = None) -> str:
    """A corpus file's text; undecodable bytes are replaced rather than failing the run."""
    root = stdlib_root() if root is None else root
    return (root / rel_path).read_bytes().decode("utf-8", errors="replace")


def token_stream(tokenizer: Any, files: Iterable[str], root: Path | None = None) -> torch.Tensor:
    """All files tokenised and concatenated, each followed by `<|endoftext|>` (int64 1-D tensor)."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    texts = [read_source(f, root) for f in files]
    # the raw `tokenizers` object batches in Rust, far faster than the python wrapper
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    for enc in encodings:
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def heldout_eval_windows(
    tokenizer: Any,
    n_windows: int = TEST_SLICE_WINDOWS,
    seq_len: int = TEST_SLICE_SEQ_LEN,
    root: Path | None = None,
    heldout_files: Sequence[str] | None = None,
) -> torch.Tensor:
    """`n_windows` windows of `seq_len` tokens, evenly spaced over the held-out token stream.

    Spreading the windows over the whole stream (rather than taking its head) averages over many
    files, which keeps the number stable if a Python release edits a few of them.
    """
    if heldout_files is None:
        heldout_files = split_corpus(corpus_files(root))[1]
    stream = token_stream(tokenizer, heldout_files, root)
    if stream.numel() < seq_len:
        raise ValueError(f"held-out stream has {stream.numel()} tokens, fewer than seq_len={seq_len}")
    span = stream.numel() - seq_len
    starts = [(i * span) // max(n_windows - 1, 1) for i in range(n_windows)]
    return torch.stack([stream[s : s + seq_len] for s in starts])


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats) of `model` over `windows` [n, seq_len]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        x = windows[i : i + batch_size]
        logits = model(input_ids=x[:, :-1]).logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train(was_training)
    return total / count


# -------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE over `texts`, wrapped for `AutoTokenizer` (eos = bos = pad = `<|endoftext|>`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False: offsets must cover leading spaces, which are indentation in code
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    wrapped = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _portable_tokenizer_config(path: Path) -> None:
    """Rewrites what transformers 5 saves into keys that transformers 4.x (>= 4.45) loads too.

    - 5.x names its internal ``TokenizersBackend`` class, which 4.x lacks;
      ``PreTrainedTokenizerFast`` is an alias of it in 5.x and the real class in 4.x.
    - 5.x saves ``extra_special_tokens`` as a list, which 4.x expects to be a dict;
      both read ``additional_special_tokens``.
    - 4.x returns ``token_type_ids`` unless told otherwise, and ``generate`` rejects them.
    """
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        cfg["additional_special_tokens"] = extra
    elif extra:
        cfg["extra_special_tokens"] = extra
    cfg["model_input_names"] = ["input_ids", "attention_mask"]
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


# ------------------------------------------------------------------------------------------ model


def build_config(hp: ModelHParams, tokenizer: Any) -> transformers.LlamaConfig:
    """The LlamaConfig for `hp`, with special-token ids taken from `tokenizer`."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    cfg = transformers.LlamaConfig(
        vocab_size=hp.vocab_size,
        hidden_size=hp.hidden_size,
        num_hidden_layers=hp.num_hidden_layers,
        num_attention_heads=hp.num_attention_heads,
        num_key_value_heads=hp.num_key_value_heads,
        intermediate_size=hp.intermediate_size,
        max_position_embeddings=hp.max_position_embeddings,
        rope_theta=hp.rope_theta,
        rms_norm_eps=hp.rms_norm_eps,
        hidden_act="silu",
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def lr_at(step: int, hp: TrainHParams) -> float:
    """Linear warm-up to `hp.lr`, then cosine decay to `hp.lr * hp.min_lr_ratio` at the last step."""
    if step < hp.warmup_steps:
        return hp.lr * (step + 1) / hp.warmup_steps
    progress = (step - hp.warmup_steps) / max(hp.steps - hp.warmup_steps, 1)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return hp.lr * (hp.min_lr_ratio + (1.0 - hp.min_lr_ratio) * cosine)


class WindowSampler:
    """Deterministic batches of non-overlapping `seq_len + 1` windows, reshuffled every epoch."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int) -> None:
        self.stream = stream
        self.width = seq_len + 1
        self.batch_size = batch_size
        self.n_windows = (stream.numel() - 1) // seq_len
        if self.n_windows < batch_size:
            raise ValueError(f"corpus has {self.n_windows} windows, fewer than one batch ({batch_size})")
        self.generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(self.n_windows, generator=self.generator)
        self.pos = 0
        self.epoch = 0

    def next_batch(self) -> torch.Tensor:
        """The next [batch_size, seq_len + 1] batch of token ids."""
        if self.pos + self.batch_size > self.n_windows:
            self.order = torch.randperm(self.n_windows, generator=self.generator)
            self.pos = 0
            self.epoch += 1
        idx = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        # windows overlap by one token so that every token is a target exactly once per epoch
        return torch.stack(
            [self.stream[i * (self.width - 1) : i * (self.width - 1) + self.width] for i in idx.tolist()]
        )


def greedy_samples(model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int) -> dict[str, str]:
    """Greedy continuations of `prompts` with HF `generate` (what the card and the log show)."""
    model.eval()
    out = {}
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        gen = model.generate(
            **ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        out[prompt] = tokenizer.decode(gen[0, ids["input_ids"].shape[1] :], skip_special_tokens=False)
    return out


# ---------------------------------------------------------------------------------------- outputs


def plot_loss_curve(log: dict[str, Any], path: Path) -> None:
    """Train loss (raw and smoothed) and held-out loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in log["train"]]
    losses = [h["loss"] for h in log["train"]]
    smooth, ema = [], None
    for v in losses:
        ema = v if ema is None else 0.9 * ema + 0.1 * v
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    ax.plot(steps, losses, color="tab:blue", alpha=0.25, linewidth=0.8, label="train (per step)")
    ax.plot(steps, smooth, color="tab:blue", linewidth=1.6, label="train (EMA 0.9)")
    ax.plot(
        [e["step"] for e in log["eval"]],
        [e["heldout_loss"] for e in log["eval"]],
        color="tab:orange",
        marker="o",
        markersize=4,
        linewidth=1.6,
        label="held-out",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    m, t = log["model"], log["train_hparams"]
    ax.set_title(
        f"default model: {log['n_params'] / 1e6:.2f}M params, "
        f"{m['num_hidden_layers']} layers x {m['hidden_size']}, "
        f"{t['batch_size']}x{t['seq_len']} tokens/step",
        fontsize=9,
    )
    ax.set_ylim(
        bottom=max(0.0, min(losses + [e["heldout_loss"] for e in log["eval"]]) - 0.3),
        top=min(max(losses), 9.0),
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_model_card(log: dict[str, Any], path: Path) -> None:
    """README.md for the model directory, filled in from the training log."""
    m, t, c, f = log["model"], log["train_hparams"], log["corpus"], log["final"]
    samples = "\n\n".join(
        f"Prompt `{json.dumps(p)}`:\n\n```python\n{p}{s}\n```" for p, s in log["samples"].items()
    )
    text = f"""# asyncengine default model

A {log["n_params"] / 1e6:.2f}M-parameter Llama-architecture model trained from scratch on the Python
standard library, so that it completes Python code. It ships inside the package so the engine
and its tests always have a real model available offline. It is a toy: expect syntactically
plausible, semantically shallow code.

Produced by `{log["command"]}`
({log["wall_time_s"]["total"] / 60:.1f} min on {t["threads"]} CPU thread(s), {log["machine"]}).

## Corpus

The `*.py` files of CPython {c["python_version"]}'s standard library (`sysconfig.get_paths()["stdlib"]`),
sorted by path, excluding directories named {", ".join(f"`{d}`" for d in c["excluded_dirs"])}.
A file is held out iff `sha256(relative path) % {c["heldout_modulus"]} == 0`.

| | files | bytes | tokens |
|---|---:|---:|---:|
| train | {c["train_files"]} | {c["train_bytes"]:,} | {c["train_tokens"]:,} |
| held-out | {c["heldout_files"]} | {c["heldout_bytes"]:,} | {c["heldout_tokens"]:,} |

## Tokenizer

Byte-level BPE (`tokenizers`), vocab {log["tokenizer"]["vocab_size"]}, trained on the training files.
Special tokens: `<|endoftext|>` (id 0; bos, eos and pad), `<|im_start|>` (1), `<|im_end|>` (2).
No BOS is added on encode. A ChatML `chat_template` is in `tokenizer_config.json` (with `tools`,
Hermes-style `<tools>`, `<tool_call>` and `<tool_response>` blocks); the chat tokens, and any
tool call, were never seen in training.

## Architecture

`LlamaForCausalLM`: hidden {m["hidden_size"]}, {m["num_hidden_layers"]} layers, \
{m["num_attention_heads"]} heads
({m["num_key_value_heads"]} KV heads, GQA), head dim {m["hidden_size"] // m["num_attention_heads"]}, SwiGLU
intermediate {m["intermediate_size"]}, RMSNorm eps {m["rms_norm_eps"]}, RoPE theta {m["rope_theta"]:g},
max positions {m["max_position_embeddings"]}, tied input/output embeddings. Weights: float32 safetensors.

## Training

AdamW (betas {t["beta1"]}, {t["beta2"]}; weight decay {t["weight_decay"]}; grad clip {t["grad_clip"]}),
peak LR {t["lr"]:g} with {t["warmup_steps"]} warm-up steps then cosine decay to \
{t["lr"] * t["min_lr_ratio"]:g},
{t["steps"]} steps of {t["batch_size"]} x {t["seq_len"]} tokens ({log["tokens_seen"]:,} tokens,
{log["tokens_seen"] / max(c["train_tokens"], 1):.2f} epochs), seed {log["seed"]}, float32,
`torch.set_num_threads({t["threads"]})`.

| | value |
|---|---:|
| final train loss (mean of last {f["train_loss_window"]} steps) | {f["train_loss"]:.4f} |
| final held-out loss ({t["eval_windows"]} x {t["seq_len"]} tokens) | {f["heldout_loss"]:.4f} |
| held-out loss on the test slice ({log["test_slice"]["n_windows"]} x {log["test_slice"]["seq_len"]} tokens) \
| {f["heldout_loss_test_slice"]:.4f} |
| threshold checked by the tests | {f["test_threshold"]:.4f} |
| wall time: tokenizer / tokenisation / training / total \
| {log["wall_time_s"]["tokenizer"]:.0f} s / {log["wall_time_s"]["tokenize"]:.0f} s \
/ {log["wall_time_s"]["train"]:.0f} s / {log["wall_time_s"]["total"]:.0f} s |
| mean training throughput (incl. evaluations; the wall time scales with load on the machine) \
| {log["tokens_seen"] / log["wall_time_s"]["train"]:,.0f} tokens/s |

![loss curve](loss_curve.png)

The full history is in `training_log.json`.

## Greedy samples (HF transformers)

{samples}
"""
    path.write_text(text)


# ------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line flags; see the module docstring."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output directory (default: the bundled assets)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: 1100, or 30 with --quick)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the shipped run used 1)")
    p.add_argument(
        "--quick", action="store_true", help="tiny model and corpus: a smoke test, well under a minute"
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 2e-3)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument(
        "--margin", type=float, default=0.05, help="test threshold = test-slice held-out loss + margin"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs the whole pipeline and returns the training log (also written to `--out`)."""
    args = parse_args(argv)
    # tokenizers' Rust thread pool reads this on first use; keep it within the thread budget
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    t_start = time.perf_counter()

    mhp = QUICK_MODEL if args.quick else ModelHParams()
    thp = QUICK_TRAIN if args.quick else TrainHParams()
    overrides = {
        k: v
        for k, v in (("steps", args.steps), ("lr", args.lr), ("batch_size", args.batch_size))
        if v is not None
    }
    thp = dataclasses.replace(thp, **overrides)
    test_seq_len = thp.seq_len if args.quick else TEST_SLICE_SEQ_LEN
    test_windows = 4 if args.quick else TEST_SLICE_WINDOWS

    root = stdlib_root()
    train_files, heldout_files = split_corpus(corpus_files(root))
    if args.quick:
        train_files, heldout_files = train_files[:QUICK_FILES], heldout_files[:3]
    print(f"corpus: {root} ({len(train_files)} train / {len(heldout_files)} held-out files)", flush=True)

    # tokenizer (train files only, so the held-out loss is honest)
    tokenizer = train_tokenizer((read_source(f, root) for f in train_files), mhp.vocab_size)
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [0, 1, 2], (
        "special tokens must be ids 0-2"
    )
    t_tok = time.perf_counter()
    print(f"tokenizer: vocab {len(tokenizer)} in {t_tok - t_start:.1f}s", flush=True)

    train_stream = token_stream(tokenizer, train_files, root)
    heldout_stream_len = token_stream(tokenizer, heldout_files, root).numel()
    eval_windows = heldout_eval_windows(tokenizer, thp.eval_windows, thp.seq_len + 1, root, heldout_files)
    test_slice = heldout_eval_windows(tokenizer, test_windows, test_seq_len, root, heldout_files)
    t_enc = time.perf_counter()
    print(
        f"tokens: train {train_stream.numel():,}, held-out {heldout_stream_len:,} ({t_enc - t_tok:.1f}s)",
        flush=True,
    )

    torch.manual_seed(args.seed)
    config = build_config(mhp, tokenizer)
    model = transformers.LlamaForCausalLM(config)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)

    # no weight decay on norms (1-D), as usual; the tied embedding is decayed
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": thp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=thp.lr,
        betas=(thp.beta1, thp.beta2),
        eps=1e-8,
    )
    sampler = WindowSampler(train_stream, thp.seq_len, thp.batch_size, args.seed)

    history: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []
    t_train = time.perf_counter()
    for step in range(thp.steps):
        lr = lr_at(step, thp)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sampler.next_batch()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), thp.grad_clip)
        optimizer.step()
        elapsed = time.perf_counter() - t_train
        history.append(
            {
                "step": step + 1,
                "loss": loss.item(),
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "elapsed_s": elapsed,
            }
        )
        if (step + 1) % thp.log_every == 0 or step == 0:
            tps = (step + 1) * thp.batch_size * thp.seq_len / elapsed
            print(
                f"step {step + 1}/{thp.steps} loss {loss.item():.4f} lr {lr:.2e} {tps:.0f} tok/s "
                f"{elapsed:.0f}s",
                flush=True,
            )
        if (step + 1) % thp.eval_every == 0 or step + 1 == thp.steps:
            hl = heldout_loss(model, eval_windows)
            evals.append({"step": step + 1, "heldout_loss": hl, "elapsed_s": time.perf_counter() - t_train})
            print(f"  eval step {step + 1}: held-out loss {hl:.4f}", flush=True)
    t_done = time.perf_counter()

    model.eval()
    test_loss = heldout_loss(model, test_slice)
    tail = min(50, len(history))
    final = {
        "train_loss": sum(h["loss"] for h in history[-tail:]) / tail,
        "train_loss_window": tail,
        "heldout_loss": evals[-1]["heldout_loss"],
        "heldout_loss_test_slice": test_loss,
        "test_margin": args.margin,
        "test_threshold": round(test_loss + args.margin, 4),
    }
    samples = greedy_samples(model, tokenizer, SAMPLE_PROMPTS, max_new_tokens=24 if args.quick else 64)

    args.out.mkdir(parents=True, exist_ok=True)
    model.config.dtype = torch.float32
    model.save_pretrained(args.out, safe_serialization=True)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=0,
        eos_token_id=[0, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=0,
        do_sample=False,
        max_new_tokens=128,
    )
    model.generation_config.save_pretrained(args.out)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json
    tokenizer.save_pretrained(args.out, save_jinja_files=False)
    _portable_tokenizer_config(args.out / "tokenizer_config.json")
    for f in args.out.iterdir():
        f.chmod(0o644)  # safetensors writes 0600; package data must be readable by every user
    t_end = time.perf_counter()

    argv_str = " ".join(sys.argv[1:]) if argv is None else " ".join(argv)
    log: dict[str, Any] = {
        "command": f"python tools/train_default_model.py {argv_str}".strip(),
        "seed": args.seed,
        "quick": args.quick,
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        "n_params": n_params,
        "model": dataclasses.asdict(mhp),
        "train_hparams": {**dataclasses.asdict(thp), "threads": args.threads},
        "tokenizer": {
            "type": "byte-level BPE",
            "vocab_size": len(tokenizer),
            "special_tokens": list(SPECIAL_TOKENS),
        },
        "corpus": {
            "stdlib": str(root),
            "python_version": platform.python_version(),
            "excluded_dirs": sorted(EXCLUDED_DIRS),
            "heldout_modulus": HELDOUT_MODULUS,
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_bytes": sum((root / f).stat().st_size for f in train_files),
            "heldout_bytes": sum((root / f).stat().st_size for f in heldout_files),
            "train_tokens": train_stream.numel(),
            "heldout_tokens": heldout_stream_len,
            "heldout_file_list": heldout_files,
        },
        "test_slice": {"n_windows": test_windows, "seq_len": test_seq_len},
        "tokens_seen": thp.steps * thp.batch_size * thp.seq_len,
        "epochs": sampler.epoch,
        "final": final,
        "wall_time_s": {
            "tokenizer": t_tok - t_start,
            "tokenize": t_enc - t_tok,
            "train": t_done - t_train,
            "total": t_end - t_start,
        },
        "samples": samples,
        "eval": evals,
        "train": history,
    }
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    plot_loss_curve(log, args.out / "loss_curve.png")
    write_model_card(log, args.out / "README.md")
    print(json.dumps({"final": final, "wall_time_s": log["wall_time_s"]}, indent=1), flush=True)
    for prompt, cont in samples.items():
        print(f"--- {prompt!r}\n{prompt}{cont}", flush=True)
    return log


if __name__ == "__main__":
    main()
