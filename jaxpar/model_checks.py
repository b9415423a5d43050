"""The model's own settings checked against each other and the mesh sizes, before anything
compiles: the shape (heads, head width, rotary scaling, sequence length), latent attention and
YaRN, multi-token prediction, and the mixture of experts (routing, dispatch, the dense prefix and
dense layers anywhere, DeepSeek's router). `jaxpar.checks.validate` calls them in its order; each
failure is a `jaxpar.config.ConfigError` naming the setting."""

from __future__ import annotations

import math

from jaxpar.config import Config, ConfigError


def validate_model(cfg: Config) -> None:
    """The model's shape on its own: heads, head width, rotary scaling, sequence length."""
    m, t = cfg.model, cfg.train
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
            f"try n_kv_heads in {divisors(m.n_heads)}"
        )
    for key, value in (
        ("model.attn_scale_dim", m.attn_scale_dim),
        ("model.rope_local_theta", m.rope_local_theta),
    ):
        if value is not None and not value > 0:
            raise ConfigError(f"{key}={value}: must be positive (or null)")
    if m.head_dim is None:
        if not m.mla.kv_lora_rank:  # latent attention's heads have their own widths
            require_divides("model.n_heads", m.n_heads, "model.d_model", m.d_model)
    elif m.head_dim < 2:
        raise ConfigError(f"model.head_dim={m.head_dim}: must be at least 2 (or null: d_model / n_heads)")
    if m.head_width % 2 and not m.mla.kv_lora_rank:  # latent attention: its rotated width (below)
        what = "model.head_dim" if m.head_dim else "model.d_model/model.n_heads"
        raise ConfigError(f"{what} = {m.head_width} is odd; rotary embeddings need an even head dimension")
    rs = m.rope_scaling
    if rs.type == "linear" and not rs.factor > 0:
        raise ConfigError(f"model.rope_scaling: factor={rs.factor}; linear scaling needs factor > 0")
    if rs.type == "llama3" and not (
        rs.factor >= 1 and 0 < rs.low_freq_factor < rs.high_freq_factor and rs.original_max_len >= 1
    ):
        raise ConfigError(
            f"model.rope_scaling: factor={rs.factor}, low_freq_factor={rs.low_freq_factor}, "
            f"high_freq_factor={rs.high_freq_factor}, original_max_len={rs.original_max_len}; "
            "llama3 scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
            "original_max_len >= 1"
        )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is above model.max_seq_len={m.max_seq_len}; "
            f"lower train.seq_len or raise model.max_seq_len"
        )


def validate_latent(cfg: Config) -> None:
    """Latent attention (model.mla) and YaRN: widths, and what MLA does not combine with."""
    m, a, rs = cfg.model, cfg.model.mla, cfg.model.rope_scaling
    if rs.type == "yarn" and not (
        rs.factor >= 1 and rs.beta_fast > rs.beta_slow > 0 and rs.original_max_len >= 1
    ):
        raise ConfigError(
            f"model.rope_scaling: factor={rs.factor}, beta_fast={rs.beta_fast}, beta_slow={rs.beta_slow}, "
            f"original_max_len={rs.original_max_len}; yarn needs factor >= 1, beta_fast > beta_slow > 0 "
            "and original_max_len >= 1"
        )
    if a.ring_latent and not a.kv_lora_rank:
        raise ConfigError(
            "model.mla.ring_latent with model.mla.kv_lora_rank=0: only latent attention has a latent "
            "to pass round the ring; set kv_lora_rank or turn ring_latent off"
        )
    if not a.kv_lora_rank:
        return
    widths = {"q_lora_rank": a.q_lora_rank or 1, "qk_nope_dim": a.qk_nope_dim + 1, "v_head_dim": a.v_head_dim}
    bad = [f"model.mla.{k}" for k, v in widths.items() if v < 1] + ["model.mla.qk_rope_dim"] * (
        a.qk_rope_dim < 2 or a.qk_rope_dim % 2
    )
    if a.kv_lora_rank < 0 or bad:
        raise ConfigError(
            f"model.mla: kv_lora_rank={a.kv_lora_rank}, q_lora_rank={a.q_lora_rank}, qk_nope_dim="
            f"{a.qk_nope_dim}, qk_rope_dim={a.qk_rope_dim}, v_head_dim={a.v_head_dim} "
            f"({', '.join(bad) or 'kv_lora_rank'}); "
            "latent attention needs kv_lora_rank >= 1, q_lora_rank null (one q projection) or >= 1, "
            "qk_nope_dim >= 0, an even qk_rope_dim >= 2 and v_head_dim >= 1"
        )
    if a.v_head_dim > m.head_width:
        raise ConfigError(
            f"model.mla.v_head_dim={a.v_head_dim} is wider than a query/key head (qk_nope_dim + "
            f"qk_rope_dim = {m.head_width}); jaxpar pads values to the query/key width, not the reverse"
        )
    if m.n_kv_heads != m.n_heads:
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} with model.mla.kv_lora_rank={a.kv_lora_rank}: latent "
            f"attention expands keys and values for every head; set model.n_kv_heads={m.n_heads}"
        )
    others = {
        "model.qk_norm": m.qk_norm,
        "model.qkv_bias": m.qkv_bias,
        "model.sliding_window": m.sliding_window is not None,
        "model.attn_scale_dim": m.attn_scale_dim is not None,
        "finetune.lora on q, k, v or o": cfg.finetune.lora.rank > 0
        and bool({"q", "k", "v", "o"} & set(cfg.finetune.lora.targets)),
    }
    for key, on in others.items():
        if on:
            raise ConfigError(
                f"{key} with model.mla.kv_lora_rank={a.kv_lora_rank}: latent attention has its own "
                "projections, norms and logit scale; turn one of them off"
            )


def validate_mtp(cfg: Config) -> None:
    """model.mtp: a depth that leaves targets within a row, a usable weight, and what the
    modules do not combine with yet."""
    mtp, m = cfg.model.mtp, cfg.model
    if not 0 <= mtp.depth < cfg.train.seq_len:
        raise ConfigError(
            f"model.mtp.depth={mtp.depth} with train.seq_len={cfg.train.seq_len}: the depth must be "
            f"between 0 (off) and {cfg.train.seq_len - 1}, so that a depth-k target t[i+k+1] can lie "
            "within a row (DeepSeek-V3 uses 1)"
        )
    if not (math.isfinite(mtp.weight) and mtp.weight >= 0):
        raise ConfigError(
            f"model.mtp.weight={mtp.weight}: the multi-token loss's weight must be finite and >= 0 "
            "(DeepSeek-V3 uses 0.3, then 0.1)"
        )
    if not mtp.depth:
        return
    if cfg.finetune.lora.rank:
        raise ConfigError(
            f"finetune.lora.rank={cfg.finetune.lora.rank} with model.mtp.depth={mtp.depth}: the "
            "multi-token modules have no adapters and would stay frozen; set model.mtp.depth=0 "
            "to fine-tune with LoRA"
        )
    if m.fp8:
        raise ConfigError(
            f"model.fp8 with model.mtp.depth={mtp.depth}: float8 matmuls are not tested with the "
            "multi-token modules yet; set model.fp8=false or model.mtp.depth=0"
        )


def validate_moe(cfg: Config, sizes: dict[str, int]) -> None:
    moe, m = cfg.model.moe, cfg.model
    _validate_dense_prefix(cfg)
    _validate_dense_layers(cfg, sizes)
    if moe.num_experts == 0:
        return
    if moe.num_experts < 0 or not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}"
        )
    patterned = m.n_layers - moe.first_dense  # the blocks after the dense prefix
    if moe.every < 1 or patterned % moe.every:
        what = f"model.n_layers={m.n_layers}"
        if moe.first_dense:
            what = f"the {patterned} blocks after model.moe.first_dense={moe.first_dense} of {what}"
        raise ConfigError(
            f"model.moe.every={moe.every} must divide {what} (an MoE MLP in "
            f"every {moe.every}-th block); try every in {divisors(patterned)}"
        )
    require_divides("mesh.expert", sizes["expert"], "model.moe.num_experts", moe.num_experts)
    require_divides("mesh.tensor", sizes["tensor"], "model.moe.d_ff", moe.d_ff or m.d_ff)
    _validate_router(moe)
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor}: use a positive "
            "number, or null for dropless routing"
        )
    if moe.shared_experts < 0:
        raise ConfigError(f"model.moe.shared_experts={moe.shared_experts} must be 0 or more")
    if moe.dispatch == "ragged" and moe.capacity_factor is not None:
        raise ConfigError(
            f"model.moe.dispatch=ragged is dropless but model.moe.capacity_factor="
            f"{moe.capacity_factor}: set model.moe.capacity_factor=null, or use "
            "model.moe.dispatch=padded for capacity routing"
        )
    if moe.dispatch == "ragged" and m.fp8:
        raise ConfigError(
            "model.moe.dispatch=ragged has no float8 grouped GEMM: with model.fp8=true "
            "use model.moe.dispatch=padded (or auto, which picks it)"
        )
    if moe.ragged_buffer_factor is not None:
        if not moe.ragged_buffer_factor >= 1:
            raise ConfigError(
                f"model.moe.ragged_buffer_factor={moe.ragged_buffer_factor}: use a number >= 1 "
                "(1 = the balanced load tokens * top_k), or null for the worst case"
            )
        if moe.dispatch == "padded" or moe.capacity_factor is not None:
            raise ConfigError(
                f"model.moe.ragged_buffer_factor={moe.ragged_buffer_factor} sizes the ragged "
                f"dispatch's buffer, but model.moe.dispatch={moe.dispatch} and "
                f"model.moe.capacity_factor={moe.capacity_factor} route padded; set it to null, "
                "or use model.moe.dispatch=ragged (or auto on GPU) with capacity_factor=null"
            )


def _validate_dense_prefix(cfg: Config) -> None:
    """model.moe.first_dense: 0, or with experts at least one block fewer than model.n_layers."""
    moe, layers = cfg.model.moe, cfg.model.n_layers
    if moe.first_dense and not moe.num_experts:
        raise ConfigError(
            f"model.moe.first_dense={moe.first_dense} with model.moe.num_experts=0: every block of a "
            "dense model is dense already; set model.moe.first_dense=0, or give the model experts"
        )
    if not 0 <= moe.first_dense < layers:
        raise ConfigError(
            f"model.moe.first_dense={moe.first_dense}: the dense blocks before the MoE ones number 0 "
            f"to model.n_layers - 1 = {layers - 1} (at least one block keeps the experts); for a "
            "dense model set model.moe.num_experts=0"
        )


def _validate_dense_layers(cfg: Config, sizes: dict[str, int]) -> None:
    """model.moe.dense_layers: distinct layer indices of a model with experts, at least one
    layer left with them; an irregular pattern (`ModelConfig.irregular_moe`) on one pipeline
    stage and with full attention only."""
    m, moe = cfg.model, cfg.model.moe
    named = f"model.moe.dense_layers={list(moe.dense_layers)}"
    if not moe.dense_layers:
        return
    if not moe.num_experts:
        raise ConfigError(
            f"{named} with model.moe.num_experts=0: every block of a dense model is dense already"
        )
    wrong = [
        i
        for i in moe.dense_layers
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < m.n_layers
    ]
    if wrong or len(set(moe.dense_layers)) < len(moe.dense_layers):
        raise ConfigError(
            f"{named}: list each dense layer once, by its index 0 to model.n_layers - 1 = {m.n_layers - 1}"
        )
    if not any(m.moe_kinds()):
        raise ConfigError(
            f"{named} leaves no layer with experts; for a dense model set model.moe.num_experts=0"
        )
    dense = m.moe_kinds().count(False)
    if m.irregular_moe() and sizes["pipe"] > 1:
        raise ConfigError(
            f"{named} with mesh.pipe={sizes['pipe']}: pipeline stages of different numbers of dense "
            f"and MoE layers do not run yet; use mesh.pipe=1, or for a pipeline the {dense} dense "
            f"layers as a prefix: model.moe.first_dense={dense} model.moe.dense_layers=[]"
        )
    if m.irregular_moe() and m.sliding_window is not None:
        raise ConfigError(
            f"model.sliding_window with {named}: dense layers between MoE ones and window patterns "
            "do not combine yet; use model.moe.dense_layers=[]"
        )


def _validate_router(moe) -> None:
    """DeepSeek-V3 routing settings (docs/experts.md): groups of at least two experts (a group
    scores its top two) of which each token keeps 1..groups, enough experts in the kept groups
    for top_k, a positive routed_scale, non-negative rates, a correction bias only with sigmoid."""
    per_group = moe.num_experts // moe.groups if moe.groups >= 1 else 0
    if moe.groups < 1 or moe.num_experts % moe.groups or (moe.groups > 1 and per_group < 2):
        raise ConfigError(
            f"model.moe.groups={moe.groups} must divide model.moe.num_experts={moe.num_experts} "
            f"into groups of at least 2 experts; try groups in {divisors(moe.num_experts)}"
        )
    if moe.groups > 1 and not 1 <= moe.topk_groups <= moe.groups:
        raise ConfigError(
            f"model.moe.topk_groups={moe.topk_groups} must be between 1 and model.moe.groups={moe.groups}"
        )
    if moe.groups > 1 and moe.top_k > moe.topk_groups * per_group:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} exceeds the {moe.topk_groups * per_group} experts of "
            f"model.moe.topk_groups={moe.topk_groups} groups of {per_group}: raise topk_groups or lower top_k"
        )
    if not moe.routed_scale > 0:
        raise ConfigError(f"model.moe.routed_scale={moe.routed_scale} must be positive (1.0 = unscaled)")
    for key in ("bias_update_rate", "seq_aux_loss_weight"):
        if getattr(moe, key) < 0:
            raise ConfigError(f"model.moe.{key}={getattr(moe, key)} must be 0 (off) or more")
    if moe.bias_update_rate > 0 and moe.score != "sigmoid":
        raise ConfigError(
            f"model.moe.bias_update_rate={moe.bias_update_rate} moves the sigmoid router's "
            f"correction bias, but model.moe.score={moe.score}: set model.moe.score=sigmoid or the rate to 0"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def require_divides(axis_key: str, axis: int, dim_key: str, dim: int) -> None:
    if dim % axis:
        raise ConfigError(
            f"{axis_key}={axis} does not divide {dim_key}={dim}; "
            f"try {axis_key.split('.')[-1]} in {divisors(dim)}"
        )
