"""`python -m jaxpar.export RUN_DIR --out DIR [--max-shard-bytes N] [--step N]`: a run's newest
intact checkpoint as a Hugging Face checkpoint of its family (safetensors + config.json). The same command
is `python -m jaxpar.convert to-hf` (jaxpar.convert also imports: from-hf).

The params are restored alone (not the optimizer state) onto one CPU device, renamed and laid out
as its family's `*ForCausalLM` expects (`jaxpar.models.families`, the table import reads with too): our
einsum weights [in, ..., out] become torch `Linear` weights [out, in] (reshape, then transpose),
and the stacked [layers, ...] arrays are split into one tensor per layer. Tensors keep the parameter dtype
(model.param_dtype, float32 by default). The files follow `save_pretrained`: one
`model.safetensors` when everything fits in `--max-shard-bytes`, otherwise
`model-00001-of-0000N.safetensors` ... plus `model.safetensors.index.json` (the weight map).
The family that writes the model decides the architecture (`jaxpar.models.families.family_of_model`):
q/k/v biases `Qwen2ForCausalLM`, per-head q/k norms `Qwen3ForCausalLM`, MoE in every block
`MixtralForCausalLM`, MoE with q/k norms `Qwen3MoeForCausalLM`, Gemma's block
`Gemma3ForCausalLM`, any other `LlamaForCausalLM`; a model no family writes (shared experts, say)
is refused by name. Rotary scaling (model.rope_scaling) goes into config.json's rope_scaling, for
Gemma 3 into the per-layer-type rope_parameters that transformers >= 5 reads.

A LoRA run (finetune.lora) exports its merged model, each adapted weight W + (alpha / rank) A B
(`jaxpar.models.lora.merged`); with `--adapter-only` its adapters alone, as a PEFT adapter
directory (`write_adapter`) to load over train.init_from's model with `peft`.

The tokenizer goes along: the run's tokenizer.json (and the tokenizer_config.json beside it, if
any) is copied when data.tokenizer names one; a byte-level run (data.tokenizer=byte) gets a
tokenizer.json built with the `tokenizers` library (`byte_tokenizer`) and a tokenizer_config.json,
so that `transformers.AutoTokenizer.from_pretrained(OUT)` encodes text to jaxpar's ids and decodes
them back to the same text. config.json's eos_token_id is the run's end-of-document id.

Where it writes (`check_out`, `staged_directory`): --out is a new or empty directory, or a previous
jaxpar export of the same kind (merged model, or adapter) holding only what that export wrote, as
its EXPORT_RECORD file lists; anything else -- another model's files, a run directory -- is refused
before anything is read or written. The export is built in a fresh directory beside --out and
renamed into place at the end, replacing the previous export whole (no stale shard or index of it
stays); a write that fails (a full disk) removes what was built, leaves --out as it was and is one
line (`WriteFailed`, exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import shutil
import tempfile
import time

import numpy as np

from jaxpar import cli
from jaxpar.checks import check_writable_dir
from jaxpar.config import ConfigError, ModelConfig
from jaxpar.models.families import registry as families

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default "5GB"
# Written last into every export: its kind and the files it wrote, so that a later export into the
# same --out can tell its own previous output (which it replaces) from anything else (refused).
EXPORT_RECORD = "jaxpar-export.json"
KINDS = {"model": "Hugging Face model", "adapter": "PEFT adapter (--adapter-only)"}


class WriteFailed(RuntimeError):
    """Writing an export (or from-hf's run directory) failed: a full disk, an I/O error. The
    message is one line naming the path; what was built is removed and --out is as it was."""


def write_failure(error: OSError, out: str, built: str | None, command: str) -> WriteFailed:
    """The one line of `error`, raised while `command` built `out` in the directory `built`
    (a path in it shown under `out`'s name; None: making that directory failed)."""
    path = error.filename if isinstance(error.filename, str) else (built or out)
    writing = built is None or path.startswith(built)
    if built is not None and writing:
        path = out + path[len(built) :]
    reason, then = error.strerror or str(error), ""
    if error.errno == errno.ENOSPC:
        reason = f"no space left on the device of {os.path.dirname(out) or '.'}"
        then = ": free some space or choose another --out, and run the same command again"
    return WriteFailed(
        f"{command} could not {'write' if writing else 'read'} {path}: {reason}; nothing was kept, "
        f"{out} is as it was{then}"
    )


def os_error(error: BaseException) -> OSError | None:
    """The OSError `error` is or was caused by (orbax's background writers pass one on as their
    own exception, or only as tensorstore's message), else None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError):
            return error
        if "No space left on device" in str(error):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def staged_directory(out: str, command: str):
    """A fresh directory beside `out` to build it in; when the block ends without an error it is
    renamed to `out`, replacing what is there (nothing, an empty directory, or a previous export
    `check_out` allowed). On an error it is removed and `out` stays as it was; an OSError (a full
    disk) is raised as a one-line WriteFailed."""
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    built = None
    try:
        os.makedirs(parent, exist_ok=True)
        built = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.writing-", dir=parent)
        yield built
        _default_modes(built)
        _replace(built, out)
    except BaseException as e:
        failed = isinstance(e, Exception) and not isinstance(e, ConfigError) and os_error(e) is not None
        if built is not None:
            _remove(built, settle=failed)
        if not failed:
            raise
        raise write_failure(os_error(e), out, built, command) from None


def _default_modes(directory: str) -> None:
    """The modes a plain mkdir and open would have given `directory` and what is in it (0777 and
    0666 less the umask): mkdtemp makes it 0700, and a writer's temporary file can leave 0600, so
    the export would be unreadable to everyone else."""
    umask = os.umask(0)
    os.umask(umask)
    for root, dirs, files in os.walk(directory):
        os.chmod(root, 0o777 & ~umask)
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~umask)


def _remove(directory: str, settle: bool) -> None:
    """Removes `directory`. With `settle` (a write failed), again while anything reappears in
    the next second: after a failed save orbax's writers (tensorstore) can still create files,
    and their directories, for a moment."""
    shutil.rmtree(directory, ignore_errors=True)
    for _ in range(10 if settle else 0):
        time.sleep(0.1)
        if os.path.lexists(directory):
            shutil.rmtree(directory, ignore_errors=True)


def _replace(built: str, out: str) -> None:
    """Renames the directory `built` to `out`; an existing `out` is moved aside first and removed
    after (restored if the rename fails)."""
    if not os.path.lexists(out):
        os.rename(built, out)
        return
    aside = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.replaced-", dir=os.path.dirname(out))
    os.rename(out, aside)  # onto the empty directory just made
    try:
        os.rename(built, out)
    except BaseException:
        os.rename(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def previous_export(out: str) -> dict | None:
    """The record (EXPORT_RECORD) of the jaxpar export in directory `out`, or None where it has
    no readable one."""
    try:
        with open(os.path.join(out, EXPORT_RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("kind") not in KINDS:
        return None
    files = record.get("files")
    return record if isinstance(files, list) and all(isinstance(n, str) for n in files) else None


def check_out(out: str, kind: str) -> None:
    """--out may be written with an export of `kind`: it does not exist, is an empty directory,
    or holds a previous jaxpar export of the same kind and nothing else (which the new one
    replaces). Else a ConfigError naming the directory and what would work; nothing written."""
    check_writable_dir(os.path.dirname(os.path.abspath(out)), "--out's parent")  # built there
    if not os.path.lexists(out):
        return
    if not os.path.isdir(out):
        raise ConfigError(f"--out {out} is a file; give a new or empty directory")
    names = set(os.listdir(out))
    if not names:
        return
    works = "give a new or empty directory, or a previous jaxpar export of the same kind (it is replaced)"
    record = previous_export(out)
    if record is None:
        shown = ", ".join(sorted(names)[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(
            f"--out {out} holds {shown} and is not a jaxpar export (it has no readable {EXPORT_RECORD}); "
            f"writing there would mix two models: {works}"
        )
    if record["kind"] != kind:
        raise ConfigError(
            f"--out {out} holds a jaxpar {KINDS[record['kind']]} export, and this export is a "
            f"{KINDS[kind]}; give another directory"
        )
    if extra := sorted(names - set(record["files"]) - {EXPORT_RECORD}):
        raise ConfigError(
            f"--out {out} holds {', '.join(extra[:3])}, which the jaxpar export there did not write "
            "(a new export replaces the directory whole); move it out, or give a new or empty directory"
        )


def hf_state_dict(params: dict, model_cfg: ModelConfig) -> dict[str, np.ndarray]:
    """jaxpar params (nested dict of arrays, as in the train state) -> {Hugging Face name: numpy
    array}, through the tensor table import reads with, of the family that writes the model
    (`jaxpar.models.families`; a ConfigError when none does).

    q/k/v_proj.weight: wq [E, N, H] -> [N*H, E]; o_proj.weight: wo [N, H, E] -> [E, N*H];
    gate/up_proj.weight: [E, F] -> [F, E]; down_proj.weight: [F, E] -> [E, F];
    lm_head.weight: [E, V] -> [V, E], absent when model.tie_embeddings (HF ties it to the
    embedding). Norm scales and the embedding [V, E] are copied as they are; with
    model.qkv_bias, q/k/v_proj.bias: [N, H] -> [N*H]. MoE: the router [E, X] -> [X, E], and
    each expert's matrices as their own tensors, transposed like the dense MLP's.
    """
    flat = {key: _to_numpy(value) for key, value in families.flatten(params).items()}
    return families.hf_tensors(flat, model_cfg)


def _to_numpy(x) -> np.ndarray:
    return np.asarray(x.value if hasattr(x, "value") else x)


def shard_names(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files, in order, each group at most `max_shard_bytes` (a
    tensor larger than the limit gets a file of its own)."""
    shards, current, size = [], [], 0
    for name, array in tensors.items():
        if current and size + array.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += array.nbytes
    return shards + [current] if current else shards


def write_safetensors(
    tensors: dict[str, np.ndarray], out: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Writes `tensors` as `save_pretrained` does; returns the file names written."""
    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    shards = shard_names(tensors, max_shard_bytes)
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file, names in zip(files, shards):
        save_file({name: tensors[name] for name in names}, os.path.join(out, file), metadata={"format": "pt"})
        weight_map.update({name: file for name in names})
    if len(files) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors.values())},
            "weight_map": weight_map,
        }
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return files


def _byte_symbols() -> list[str]:
    """The character that stands for each byte 0-255 in a byte-level tokenizer.json (the
    convention of the `tokenizers` ByteLevel pre-tokenizer and decoder, GPT-2's): a printable
    Latin-1 byte is its own character; the 68 others (controls, space, 0x7F-0xA0, the soft
    hyphen 0xAD) take U+0100, U+0101, ... in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, shifted = [], 0x100
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(shifted))
            shifted += 1
    return symbols


def byte_tokenizer():
    """jaxpar's byte tokenizer (`jaxpar.corpus.documents.ByteTokenizer`) as a `tokenizers.Tokenizer`: token
    id b is the byte b of the text's UTF-8, and 256 is the end-of-document token (special, so
    skipped when decoding with skip_special_tokens). A BPE model without merges over the 256
    byte symbols: it never joins two bytes, so encoding gives one id per byte; the ByteLevel
    decoder turns ids back into bytes and decodes them as UTF-8, an invalid sequence becoming
    U+FFFD as in ByteTokenizer.decode."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from jaxpar.corpus.documents import EOD_TOKEN, ByteTokenizer

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # Bytes to symbols only; no splitting into words (with no merges it changes no id).
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(EOD_TOKEN, special=True)])
    assert tokenizer.token_to_id(EOD_TOKEN) == ByteTokenizer.eod_id
    return tokenizer


def write_tokenizer(cfg, out: str) -> int | None:
    """Writes the run's tokenizer into `out` (tokenizer.json, tokenizer_config.json, and
    `write_chat_template`'s file); returns its end-of-document id, or None when data.tokenizer
    names no file here (nothing written)."""
    eod = _write_tokenizer_files(cfg, out)
    if eod is not None:
        write_chat_template(cfg, out)
    return eod


def write_chat_template(cfg, out: str) -> None:
    """chat_template.jinja in `out`, where transformers 5 reads a tokenizer's chat template from:
    the one the run trained with (RUN_DIR/chat_template.jinja), else the one beside its
    tokenizer; nothing when neither exists."""
    import shutil

    from jaxpar.corpus.chat import TEMPLATE_FILE

    for directory in (cfg.train.run_dir, os.path.dirname(cfg.data.tokenizer)):
        if directory and os.path.isfile(path := os.path.join(directory, TEMPLATE_FILE)):
            shutil.copyfile(path, os.path.join(out, TEMPLATE_FILE))
            return


def _write_tokenizer_files(cfg, out: str) -> int | None:
    import shutil

    from jaxpar.corpus.documents import EOD_TOKEN, ByteTokenizer, make_tokenizer

    if cfg.data.tokenizer == "byte":
        byte_tokenizer().save(os.path.join(out, "tokenizer.json"))
        settings = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOD_TOKEN,
            # jaxpar reads "<|endoftext|>" in a text as its 13 bytes; so does transformers with
            # this (the tokenizers library alone turns it into 256).
            "split_special_tokens": True,
            "clean_up_tokenization_spaces": False,  # decode gives the text back, spaces included
            "model_max_length": cfg.model.max_seq_len,
        }
        with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
            json.dump(settings, f, indent=2)
        return ByteTokenizer.eod_id
    if not os.path.isfile(cfg.data.tokenizer):
        return None
    beside = os.path.join(os.path.dirname(cfg.data.tokenizer), "tokenizer_config.json")
    shutil.copyfile(cfg.data.tokenizer, os.path.join(out, "tokenizer.json"))
    if os.path.isfile(beside):
        shutil.copyfile(beside, os.path.join(out, "tokenizer_config.json"))
    return make_tokenizer(cfg.data).eod_id


def load_params(run_dir: str, step: int | None = None, merge_lora: bool = True):
    """(config, params as numpy arrays, step) from the run's newest intact checkpoint (or
    `step`), restored onto one CPU device without the optimizer state. A LoRA run's adapters
    are folded into their weights (`jaxpar.models.lora.merged`: the base model's tree, what
    `sample` and the merged export read) unless `merge_lora` is false."""
    import jax

    from jaxpar import config as config_lib
    from jaxpar.hf import base as base_lib
    from jaxpar.models import lora as lora_lib
    from jaxpar.training.trainer import build_trainer

    cfg = config_lib.load_config(os.path.join(run_dir, "config.yaml"))
    sizes = {axis: 1 for axis in config_lib.MESH_AXES}
    trainer = build_trainer(cfg, sizes, devices=jax.devices("cpu")[:1])
    params, step = base_lib.params_of(trainer, run_dir, step)
    params = jax.tree.map(np.asarray, params)
    if merge_lora and lora_lib.enabled(cfg.finetune.lora):
        params = lora_lib.merged(params, cfg.finetune.lora)
    return cfg, params, step


def peft_base(init_from: str | None) -> dict:
    """adapter_config.json's entries naming the base model, from a LoRA run's train.init_from
    (already a local directory): a Hub model's id and commit where it is a snapshot in
    huggingface_hub's cache (what PEFT loads by name), a Hugging Face directory's path, and a
    jaxpar run directory's path -- which PEFT cannot load: write that base with `to-hf` and
    load the adapter over the result. No init_from (the random init of train.seed): null."""
    from jaxpar.hf import hub

    if init_from is None:
        return {"base_model_name_or_path": None}
    if (snapshot := hub.snapshot_of(init_from)) is not None:
        return {"base_model_name_or_path": snapshot[0], "revision": snapshot[1]}
    return {"base_model_name_or_path": init_from}


def write_adapter(cfg, params: dict, out: str) -> dict[str, np.ndarray]:
    """A LoRA run's adapters as a PEFT adapter directory: adapter_model.safetensors (PEFT's
    names, `jaxpar.models.lora.peft_tensors`) and adapter_config.json (r, lora_alpha,
    lora_dropout, target_modules, the base: `peft_base`). Returns the tensors."""
    from safetensors.numpy import save_file

    from jaxpar.models import lora as lora_lib

    lora = cfg.finetune.lora
    if not lora_lib.enabled(lora):
        raise ConfigError(
            f"--adapter-only: this run has no LoRA adapters (finetune.lora.rank={lora.rank}); "
            "export the whole model without --adapter-only"
        )
    tensors = lora_lib.peft_tensors(params, families.tensor_table(cfg.model), cfg.model.n_layers)
    modules = sorted({name.split(".")[-3] for name in tensors})  # ...q_proj.lora_A.weight -> q_proj
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        **peft_base(cfg.train.init_from),
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(settings, f, indent=2)
    return tensors


def export(
    run_dir: str,
    out: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    step: int | None = None,
    adapter_only: bool = False,
) -> dict:
    """Writes the Hugging Face checkpoint of `run_dir` into `out` (a LoRA run's merged model),
    or with `adapter_only` its LoRA adapters in PEFT's format; returns a summary. `out` is
    checked first (`check_out`) and built beside itself (`staged_directory`)."""
    kind = "adapter" if adapter_only else "model"
    check_out(out, kind)
    cfg, params, step = load_params(run_dir, step, merge_lora=not adapter_only)
    with staged_directory(out, "to-hf") as built:
        if adapter_only:
            tensors = write_adapter(cfg, params, built)
            files = ["adapter_model.safetensors"]
        else:
            tensors = hf_state_dict(params, cfg.model)
            files = write_model(cfg, tensors, built, max_shard_bytes)
        record = {
            "kind": kind,
            "run_dir": os.path.abspath(run_dir),
            "step": step,
            "files": sorted(os.listdir(built)),
        }
        with open(os.path.join(built, EXPORT_RECORD), "w") as f:
            json.dump(record, f, indent=2)
    summary = {"step": step, "out": out, "files": files, "tensors": len(tensors), "bytes": _nbytes(tensors)}
    base = cfg.train.init_from
    if adapter_only and base is not None and os.path.isfile(os.path.join(base, "config.yaml")):
        summary["note"] = (
            f"the adapters' base is the jaxpar run {base}, which PEFT cannot load: write it "
            f"with `python -m jaxpar.convert to-hf {base} --out DIR` and load the adapter over DIR"
        )
    return summary


def write_model(cfg, tensors: dict[str, np.ndarray], out: str, max_shard_bytes: int) -> list[str]:
    """The model's safetensors (`write_safetensors`), tokenizer (`write_tokenizer`) and
    config.json (with the tokenizer's end-of-document id) into `out`; returns the safetensors
    files written."""
    files = write_safetensors(tensors, out, max_shard_bytes)
    eod_id = write_tokenizer(cfg, out)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(
            {**families.hf_config(cfg.model), **({} if eod_id is None else {"eos_token_id": eod_id})},
            f,
            indent=2,
        )
    return files


def _nbytes(tensors: dict) -> int:
    return sum(t.nbytes for t in tensors.values())


def main(argv: list[str] | None = None, prog: str = "python -m jaxpar.export") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Export a run's newest intact checkpoint as Hugging Face safetensors of its family.",
    )
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=DEFAULT_MAX_SHARD_BYTES,
        help=f"largest safetensors file (default {DEFAULT_MAX_SHARD_BYTES})",
    )
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run (finetune.lora): write its adapters in PEFT's format (adapter_model.safetensors, "
        "adapter_config.json) instead of the merged model",
    )
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on read-only restores
    return cli.run(lambda: _export_command(args), failures={FileNotFoundError: 1, WriteFailed: 1})


def _export_command(args) -> int:
    check_writable_dir(args.out, "--out")  # before the checkpoint is read
    if args.max_shard_bytes < 1:
        raise ConfigError(f"--max-shard-bytes={args.max_shard_bytes}: must be at least 1")
    summary = export(args.run_dir, args.out, args.max_shard_bytes, args.step, args.adapter_only)
    print(
        f"exported step {summary['step']}: {summary['tensors']} tensors, "
        f"{summary['bytes'] / 1e6:.1f} MB in {len(summary['files'])} file(s) -> {summary['out']}"
    )
    if "note" in summary:
        print(summary["note"])
    return 0
