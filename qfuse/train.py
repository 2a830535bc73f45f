"""`qfuse train`: train a small Gemma 3 text decoder from scratch on the stdlib corpus.

A byte-level BPE tokenizer is trained with `tokenizers` (or an existing tokenizer.json
is reused, ``tokenizer``: a test model that shares the bundled model's vocabulary); the model is
qfuse's own Decoder, whose MLP goes through `qfuse.ops.mlp` (the fused,
differentiable GeGLU on CUDA, the spelled-out path on CPU). AdamW with linear
warm-up and cosine decay, bf16 autocast on CUDA, validation loss at intervals,
a progress bar. The checkpoint is an HF-layout folder: model.safetensors,
config.json (gemma3_text) and tokenizer.json, loadable by qfuse and by
transformers. The destination is checked before training starts (free space
included) and the model appears only once complete (`saving.staged_folder`);
``force`` replaces the model files of an existing model folder and keeps every
other file, as `qfuse quantize --force` does. If the save fails after training
(a full disk), the trained model is written to a folder elsewhere and the error
says where (`ModelKept`), so the run is not lost.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from .corpus import load_corpus
from .errors import UserError
from .models import Decoder, ModelConfig
from .saving import check_destination, file_mode, save_safetensors, staged_folder


@dataclass
class TrainSettings:
    vocab_size: int = 4096
    hidden_size: int = 384
    # ~11M parameters: the stdlib corpus is only ~2.4M tokens, so a larger model
    # would only overfit sooner (the best validation checkpoint is kept anyway).
    intermediate_size: int = 1024
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    sliding_window: int = 128
    # Every Nth layer attends to the whole context, the others to the sliding window
    # (Gemma 3: 6); a model of fewer layers than N gets none of full attention.
    sliding_window_pattern: int = 6
    seq_len: int = 256
    batch_size: int = 32
    steps: int = 2500
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_batches: int = 8
    max_chars: int | None = None  # cap the corpus (tests)
    seed: int = 0
    # An existing byte-level BPE tokenizer.json to train with instead of training one: its
    # vocabulary must be vocab_size entries with <pad>, <eos>, <bos> at ids 0, 1, 2.
    tokenizer: str | None = None

    def check(self) -> None:
        """UserError for a setting training cannot use (train() calls it before any work;
        other uses, such as a config for a test model, need not pass it)."""
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                     "sliding_window_pattern", "seq_len", "batch_size", "steps", "eval_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise UserError(f"{_flag(name)} must be at least 1, got {getattr(self, name)}")
        # The byte-level BPE starts from 256 bytes and 3 special tokens.
        if self.vocab_size < 259:
            raise UserError(f"--vocab-size must be at least 259, got {self.vocab_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UserError(f"--num-attention-heads ({self.num_attention_heads}) must be a "
                            f"multiple of --num-key-value-heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise UserError(f"--head-dim must be even (rotary embedding), got {self.head_dim}")
        if not self.lr > 0 or self.warmup < 0 or self.weight_decay < 0:
            raise UserError("--lr must be > 0, --warmup and --weight-decay >= 0")
        if self.max_chars is not None and self.max_chars < 1:
            raise UserError(f"--max-chars must be at least 1, got {self.max_chars}")
        if self.tokenizer is not None:
            load_tokenizer_file(self.tokenizer, self.vocab_size)


def load_tokenizer_file(path: str | Path, vocab_size: int) -> Tokenizer:
    """The tokenizer.json at ``path``; UserError unless it has ``vocab_size`` entries and
    the special tokens the config names (<pad> 0, <eos> 1, <bos> 2)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--tokenizer {path}: not a readable tokenizer.json "
                        f"({getattr(e, 'strerror', None) or e})") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 -- `tokenizers` raises a bare Exception
        raise UserError(f"--tokenizer {path}: not a readable tokenizer.json ({e})") from None
    if tok.get_vocab_size() != vocab_size:
        raise UserError(f"--tokenizer {path}: {tok.get_vocab_size()} entries, but "
                        f"--vocab-size is {vocab_size}")
    if [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>")] != [0, 1, 2]:
        raise UserError(f"--tokenizer {path}: needs <pad>, <eos>, <bos> at ids 0, 1, 2")
    return tok


class ModelKept(Exception):
    """Mixed into the error `train` raises when the trained model could not be saved to
    ``out``: ``kept`` is the folder it was saved to instead (None if none had room),
    ``record`` the run's record."""

    kept: Path | None
    record: dict


class ModelKeptError(ModelKept, OSError):
    """The save to ``out`` failed with an OSError (a full disk); see `ModelKept`."""


class ModelKeptUserError(ModelKept, UserError):
    """``out`` was refused at save time (it changed during training); see `ModelKept`."""


def checkpoint_bytes(s: TrainSettings) -> int:
    """At least the bytes `save_checkpoint` writes for these settings (bf16 weights, and
    16 bytes per vocabulary entry for the tokenizer, which takes 29-64 in practice;
    headers and config.json left out): the room `train` asks of the destination."""
    with torch.device("meta"):  # shapes only: no memory, no initialization
        model = Decoder(ModelConfig.from_dict(hf_config(s)))
    return sum(t.numel() for t in model.state_dict().values()) * 2 + 16 * s.vocab_size


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def train_tokenizer(text: str, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    # Train on chunks: one long string would be a single pre-tokenizer input.
    tok.train_from_iterator((text[i:i + 100_000] for i in range(0, len(text), 100_000)), trainer)
    return tok


def hf_config(s: TrainSettings) -> dict:
    """A gemma3_text config.json for these settings (HF field names)."""
    return {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": s.vocab_size, "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_hidden_layers,
        "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 4 * s.seq_len, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": s.head_dim, "sliding_window": s.sliding_window,
        "layer_types": ["sliding_attention" if (i + 1) % s.sliding_window_pattern
                        else "full_attention"
                        for i in range(s.num_hidden_layers)],
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        "attention_bias": False, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "torch_dtype": "bfloat16",
    }


def init_weights(model: Decoder, seed: int) -> None:
    """Random starting weights drawn from ``seed``: each 2-D parameter N(0, std²), std 0.02
    for embeddings and fan_in^-1/2 otherwise."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 if "embed" in name else p.shape[1] ** -0.5
            p.data.copy_(torch.randn(p.shape, generator=g) * std)
        # norms stay at zero: Gemma's (1 + w) makes them identity at start


def _batches(data: torch.Tensor, batch: int, seq: int, g: torch.Generator):
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    x = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
    return x[:, :-1], x[:, 1:]


def train(out: str | Path, s: TrainSettings, device: str | torch.device | None = None,
          log=print, force: bool = False) -> dict:
    """Train and save to ``out``; returns the record (losses, timings, settings).

    UserError before any training if ``out`` is not a folder qfuse may write a model
    into (see `saving.check_destination`): a non-empty one needs ``force``; OSError
    (ENOSPC) if its file system lacks `checkpoint_bytes`. If saving to ``out`` fails after
    training, the model is saved to a new folder under the temporary directory (or the
    home folder) and the error, a `ModelKept`, names that folder in its message."""
    # Refuse now rather than after hours of training; the save checks again.
    s.check()
    need = checkpoint_bytes(s)
    check_destination(out, force=force, need=need)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(s.seed)
    train_text, val_text = load_corpus(s.max_chars)
    tok = (load_tokenizer_file(s.tokenizer, s.vocab_size) if s.tokenizer is not None
           else train_tokenizer(train_text, s.vocab_size))
    train_ids = torch.tensor(tok.encode(train_text).ids, dtype=torch.int64)
    val_ids = torch.tensor(tok.encode(val_text).ids, dtype=torch.int64)
    if min(len(train_ids), len(val_ids)) <= s.seq_len + 1:
        raise UserError(f"the corpus ({len(train_ids)} training, {len(val_ids)} validation "
                        f"tokens) is too short for --seq-len {s.seq_len}; raise --max-chars")
    log(f"corpus: {len(train_ids):,} train / {len(val_ids):,} validation tokens, "
        f"vocab {tok.get_vocab_size()}")
    cfg_dict = hf_config(s)
    model = Decoder(ModelConfig.from_dict(cfg_dict))
    init_weights(model, s.seed)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters on {device}")
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr,
                            betas=(0.9, 0.95), fused=device.type == "cuda")

    def lr_at(step: int) -> float:
        if step < s.warmup:
            return (step + 1) / s.warmup
        progress = (step - s.warmup) / max(1, s.steps - s.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    g = torch.Generator().manual_seed(s.seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def loss_of(x, y):
        with autocast:
            logits = model(x.to(device))
        return F.cross_entropy(logits.float().flatten(0, 1), y.to(device).flatten())

    @torch.no_grad()
    def validation_loss() -> float:
        model.eval()
        gv = torch.Generator().manual_seed(1234)  # the same batches every time
        losses = [loss_of(*_batches(val_ids, s.batch_size, s.seq_len, gv)).item()
                  for _ in range(s.eval_batches)]
        model.train()
        return sum(losses) / len(losses)

    record = {"settings": asdict(s), "parameters": n_params, "device": str(device),
              "train_loss": [], "val_loss": [], "tokens_train": len(train_ids),
              "tokens_validation": len(val_ids)}
    best_val, best_state, best_step = math.inf, None, -1
    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(s.steps), desc="training", unit="step")
    for step in bar:
        loss = loss_of(*_batches(train_ids, s.batch_size, s.seq_len, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        record["train_loss"].append((step, loss.item()))
        if (step + 1) % s.eval_every == 0 or step == s.steps - 1:
            v = validation_loss()
            record["val_loss"].append((step, v))
            bar.set_postfix(loss=f"{loss.item():.3f}", val=f"{v:.3f}")
            if v < best_val:  # early stopping: the corpus is small enough to overfit
                best_val, best_step = v, step
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    record["seconds"] = time.perf_counter() - t0
    record["best_val_loss"], record["best_step"] = best_val, best_step
    model.load_state_dict(best_state)
    try:
        with staged_folder(out, force=force, need=need) as tmp:
            save_checkpoint(model, tok, cfg_dict, tmp)
    except (OSError, UserError) as e:
        raise _kept_elsewhere(e, model, tok, cfg_dict, need, record) from e
    return record


def _kept_elsewhere(e: OSError | UserError, model: Decoder, tok: Tokenizer, cfg_dict: dict,
                    need: int, record: dict) -> ModelKept:
    """Save the trained model where there is room, and ``e`` again saying where."""
    tried = []
    for base in dict.fromkeys([Path(tempfile.gettempdir()), Path.home()]):
        try:
            if shutil.disk_usage(base).free < need:
                tried.append(f"{base}: too little free space")
                continue
            folder = Path(tempfile.mkdtemp(prefix="qfuse-train-", dir=base))
        except OSError as err:
            tried.append(f"{base}: {err.strerror or err}")
            continue
        try:
            save_checkpoint(model, tok, cfg_dict, folder)
        except OSError as err:
            shutil.rmtree(folder, ignore_errors=True)
            tried.append(f"{base}: {err.strerror or err}")
            continue
        os.chmod(folder, file_mode(folder=True))  # mkdtemp makes it 0700
        return _again(e, f"the trained model is kept in {folder}", folder, record)
    return _again(e, f"the trained model could not be kept either ({'; '.join(tried)})",
                  None, record)


def _again(e: OSError | UserError, note: str, kept: Path | None, record: dict) -> ModelKept:
    if isinstance(e, OSError):
        err = ModelKeptError(e.errno, f"{e.strerror or e}; {note}", e.filename)
    else:
        err = ModelKeptUserError(f"{e}; {note}")
    err.kept, err.record = kept, record
    return err


# Every file of the bundled model stays under 16 MB; 15 MiB leaves room for the header.
MAX_SHARD_BYTES = 15 * 2**20


def save_checkpoint(model: Decoder, tok: Tokenizer, cfg_dict: dict, out: str | Path) -> None:
    """Weights in bfloat16 (the dtype trained under autocast; half the bytes of fp32),
    sharded under MAX_SHARD_BYTES, with config.json and tokenizer.json."""
    out = Path(out)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save_safetensors(state, out, MAX_SHARD_BYTES, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2) + "\n")
    # Through Python, not tok.save: its I/O errors are plain Exceptions without a file name.
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
