"""Train the `tiny` Llama preset on a public-domain novel, byte by byte, then sample from it.

    python examples/train_tiny_lm.py /tmp/tiny_ckpt            # about 2-3 minutes on 2 cores
    python examples/train_tiny_lm.py /tmp/tiny_ckpt --steps 50  # a quick smoke run

The corpus is jaxkv/data/botchan.txt (see jaxkv/data/README.md); its last 10% is held out for
the evaluation loss. Optimiser: AdamW, linear warmup then cosine decay, global-norm clipping.
The checkpoint directory loads with `jaxkv.models.load_checkpoint(path)`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
from flax import nnx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.cli_args import out_dir  # noqa: E402
from benchmarks.kv_memory import training_overflow  # noqa: E402
from jaxkv.models import ByteTokenizer, Llama, LlamaConfig, save_checkpoint  # noqa: E402
from jaxkv.models.train import Trainer, greedy_generate, make_optimizer  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "jaxkv" / "data" / "botchan.txt"
SAMPLE_PROMPTS = ("I was ", "The teacher said ", '"What ')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("checkpoint", type=out_dir, help="directory to write the trained checkpoint to")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--peak-lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--sample-tokens", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="change a field of the tiny preset, e.g. --override num_layers=2",
    )
    args = p.parse_args(argv)
    for name, least in (
        ("steps", 1), ("batch_size", 1), ("seq_len", 1), ("eval_every", 1), ("eval_batches", 1),
        ("warmup_steps", 0), ("sample_tokens", 0), ("seed", 0),
    ):  # fmt: skip
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= {least}")
    if args.seed >= 2**63:  # jax.random.key takes int64: OverflowError after setup
        p.error(f"--seed {args.seed} must be < 2**63")
    if not 0 < args.peak_lr < math.inf:  # nan fails too: it would train to NaN weights
        p.error(f"--peak-lr {args.peak_lr} must be a finite number > 0")
    try:
        args.config = tiny_config(args.override)
    except ValueError as e:
        p.error(f"--override: {e}")
    # Past the device's memory it failed once the model was built.
    if overflow := training_overflow(args.config, args.batch_size, args.seq_len):
        p.error(f"--override, --batch-size and --seq-len: {overflow}")
    try:
        size = args.corpus.stat().st_size  # bytes: the byte tokenizer's tokens
    except OSError as e:
        p.error(f"--corpus {args.corpus}: {e.strerror or e}")
    if args.corpus.is_dir():  # its stat size is no text's: read_bytes failed after setup
        p.error(f"--corpus {args.corpus} is a folder; give a text file")
    held_out = size - train_size(size)
    if min(held_out, train_size(size) - 1) < args.seq_len + 1:  # train: a start to draw
        p.error(
            f"--corpus {args.corpus} of {size} bytes is too short for --seq-len "
            f"{args.seq_len}: its held-out last 10% ({held_out} bytes) and the rest must "
            f"each hold a window of seq_len + 1 bytes"
        )
    if args.seq_len > args.config.max_position_embeddings:
        p.error(
            f"--seq-len {args.seq_len} must be <= max_position_embeddings="
            f"{args.config.max_position_embeddings} (raise it with --override)"
        )
    return args


def train_size(num_bytes: int) -> int:
    """How many leading bytes of a corpus of `num_bytes` train (the rest is held out)."""
    return int(num_bytes * 0.9)


def tiny_config(overrides: list[str]) -> LlamaConfig:
    """The tiny preset with FIELD=INT overrides; ValueError naming a bad one."""
    fields = {}
    int_fields = {f.name for f in dataclasses.fields(LlamaConfig) if f.type == "int"}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in int_fields:
            raise ValueError(f"{item!r} must be FIELD=INT with FIELD one of {sorted(int_fields)}")
        try:
            fields[key] = int(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not an int") from None
    config = LlamaConfig.preset("tiny", **fields)
    if config.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={config.vocab_size} must hold the byte tokenizer's "
            f"{ByteTokenizer.vocab_size} ids"
        )
    # The byte tokenizer's EOS ends a generation: Engine stops there unless ignore_eos.
    return dataclasses.replace(config, eos_token_ids=(ByteTokenizer.eos_id,))


def random_windows(
    data: np.ndarray,  # i32[num_tokens]
    rng: np.random.Generator,
    batch_size: int,
    length: int,
) -> np.ndarray:  # i32[batch_size, length]
    starts = rng.integers(0, len(data) - length, size=batch_size)
    return data[starts[:, None] + np.arange(length)]


def eval_windows(
    data: np.ndarray,  # i32[num_tokens]
    num_batches: int,
    batch_size: int,
    length: int,
) -> list[np.ndarray]:  # num_batches x i32[batch_size, length]
    """Evenly spaced, fixed windows of the held-out text, so every evaluation is comparable."""
    n = num_batches * batch_size
    starts = np.linspace(0, len(data) - length, n).astype(np.int64)
    windows = data[starts[:, None] + np.arange(length)]
    return list(windows.reshape(num_batches, batch_size, length))


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    tok = ByteTokenizer()
    data = tok.encode_array(args.corpus.read_bytes())
    split = train_size(len(data))
    train_data, eval_data = data[:split], data[split:]

    config = args.config
    model = Llama(config, rngs=nnx.Rngs(args.seed))
    tx = make_optimizer(
        peak_lr=args.peak_lr, warmup_steps=args.warmup_steps, total_steps=args.steps
    )
    trainer = Trainer.create(model, tx)
    rng = np.random.default_rng(args.seed)
    evals = eval_windows(eval_data, args.eval_batches, args.batch_size, args.seq_len + 1)
    eval_loss = lambda: float(np.mean([trainer.eval_loss(b) for b in evals]))
    print(
        f"tiny Llama: {config.num_params:,} parameters; corpus {len(train_data):,} train / "
        f"{len(eval_data):,} held-out bytes"
    )
    initial_eval = eval_loss()
    print(f"step 0: eval loss {initial_eval:.3f}")

    tokens_per_step = args.batch_size * args.seq_len
    start = time.perf_counter()
    cpu_start = time.process_time()
    bar = tqdm(range(1, args.steps + 1), desc="train", unit="step")
    train_loss = float("nan")
    for step in bar:
        loss = trainer.step(random_windows(train_data, rng, args.batch_size, args.seq_len + 1))
        if step % 10 == 0 or step == args.steps:
            train_loss = float(loss)  # syncs; only every few steps to keep the device busy
            elapsed = time.perf_counter() - start
            bar.set_postfix(
                loss=f"{train_loss:.3f}", tok_s=f"{step * tokens_per_step / elapsed:,.0f}"
            )
        if step % args.eval_every == 0 and step != args.steps:
            train_loss = float(loss)
            tqdm.write(f"step {step}: train loss {train_loss:.3f}, eval loss {eval_loss():.3f}")
    train_seconds = time.perf_counter() - start
    final_eval = eval_loss()
    print(
        f"done: {args.steps} steps in {train_seconds:.0f}s wall, "
        f"{time.process_time() - cpu_start:.0f}s CPU; train loss {train_loss:.3f}, "
        f"eval loss {final_eval:.3f} nats/byte"
    )

    trained = trainer.model()
    path = save_checkpoint(trained, args.checkpoint)
    print(f"checkpoint written to {path}")
    for prompt in SAMPLE_PROMPTS:
        out = greedy_generate(trained, tok.encode(prompt), args.sample_tokens, pad_id=tok.pad_id)
        print(f"greedy | {prompt}{tok.decode(out)!r}")
    return {
        "initial_eval_loss": initial_eval,
        "train_loss": train_loss,
        "eval_loss": final_eval,
        "train_seconds": train_seconds,
        "cpu_seconds": time.process_time() - cpu_start,
    }


if __name__ == "__main__":
    main()
