"""Every default of mtplm, as dataclasses, and the one way to override them (key=value strings).

Nothing else in the package declares a default: the CLI and files only override these.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from mtplm.compat import tomllib
from mtplm.errors import UserError
from mtplm.registry import CONFIDENCE, HEAD_FORMS, OBJECTIVES, STRATEGIES, TRAINABLE, WINDOWS

DRAFTING = ("linear", "quadratic", "tree", "lookup")  # lookup: drafts copied from the text alone (decode/lookup.py)
LOOKUP_TOKENS = 8  # copied drafts per pass when a mode asks for lookup without a number
# CLI and server mode when not told: the fastest that keeps quality as measured (README: 1.54x plain alone);
# server load policy: plain passes from 2 sequences on (batched, copied drafts measured 0.67-0.95x of plain)
DEFAULT_MODE, DEFAULT_LOAD_POLICY = "verified:lookup", "2:1"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # LoRA wraps these
METHODS = ("mask", "heads")
DTYPES = ("fp32", "bf16")
SCHEDULES = ("cosine", "constant")  # the learning rate after warm-up: cosine to 0.1x, or constant
SELF_GEN_ENGINES = ("hf", "llama-server")  # TrainConfig.self_gen_engine: what generates the model's own answers


@dataclass(frozen=True)
class Thresholds:
    """A checkpoint's decoding defaults (mtplm.json's `thresholds`, with the checkpoint's k_max), typed."""

    tau: float = 0.9  # ConfAdapt threshold when neither the user nor calibration sets one
    k_max: int = 8  # tokens per pass of ConfAdapt and verified (the checkpoint's one k_max)
    confidence: str = "top1"  # the measure tau and tau_per_position apply to
    tau_per_position: tuple[float, ...] | None = None  # calibrated, one per block position
    calibration: dict | None = None  # what `mtplm calibrate` measured: target, calibration, held_out

    @classmethod
    def from_json(cls, raw: dict, k_max: int) -> Thresholds:
        taus = raw.get("tau_per_position")
        return cls(tau=float(raw.get("tau", cls.tau)), k_max=int(raw.get("k_max", k_max)),
                   confidence=str(raw.get("confidence", cls.confidence)),
                   tau_per_position=tuple(float(t) for t in taus) if taus else None,
                   calibration=raw.get("calibration"))

    def to_json(self) -> dict:
        """The `thresholds` table of mtplm.json (k_max lives once, beside it)."""
        out: dict = {"tau": self.tau, "confidence": self.confidence}
        if self.tau_per_position is not None:
            out["tau_per_position"] = list(self.tau_per_position)
        if self.calibration is not None:
            out["calibration"] = self.calibration
        return out


@dataclass
class DecodeConfig:
    # a STRATEGIES registry name: ntp | static | confadapt | verified (lossless); the CLI and server: DEFAULT_MODE
    mode: str = "ntp"
    k: int = 4  # static mode: tokens emitted per forward
    k_max: int | None = None  # confadapt: block size; verified: most tokens per pass; None -> the checkpoint's
    tau: float | None = None  # confadapt threshold; None -> the checkpoint's calibrated value
    confidence: str = "top1"  # a CONFIDENCE registry name
    backoff: bool = False  # lower k_max after repeated single-token steps, raise it when confidence returns
    backoff_patience: int = 3  # consecutive single-token steps before halving k_max
    backoff_floor: int = 2
    # verified mode; defaults = the fastest wall-clock setting measured on this CPU (README, Benchmark).
    # Where extra rows in a pass are nearly free (GPU), quadratic drafting accepts the most tokens per pass.
    drafting: str = "linear"  # linear (one mask block, after the last draft) | quadratic (a block after every draft)
    #                           | tree (candidates from the heads' or mask slots' top choices, verified at once)
    tree_widths: str = "2,2"  # tree drafting: candidates per depth from the top choices; deeper depths 1
    lookup: int = 0  # drafts copied from the text per pass (decode/lookup.py) beside mask drafts; 0: none
    window: str = "adaptive"  # a WINDOWS registry name (decode/windows.py)
    temperature: float = 0.0  # 0 = greedy; > 0 samples (verified: exactly the model's distribution)
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    seed: int = 0

    def needs_conversion(self) -> bool:
        """Whether the mode needs mask slots or heads (every mode but plain, and lookup drafting alone)."""
        return self.mode != "ntp" and not (self.mode == "verified" and self.drafting == "lookup")

    def lookup_tokens(self) -> int:
        """Copied drafts per pass: `lookup`, or LOOKUP_TOKENS for drafting=lookup (alone: any model) left at 0."""
        return self.lookup or (LOOKUP_TOKENS if self.drafting == "lookup" else 0)

    def verifies_rest(self) -> bool:
        """ConfAdapt that keeps its unconfident slots as drafts, verified next pass (strategies.ConfidentVerified)."""
        return self.mode == "confadapt" and (self.drafting == "quadratic" or self.lookup > 0)

    def _check_lookup(self) -> None:
        if self.mode == "confadapt" and self.drafting not in ("linear", "quadratic"):
            raise UserError(f"confadapt verifies its leftover slots with linear or quadratic drafting, not "
                            f"{self.drafting!r}: use confadapt+quadratic, confadapt+lookup or confadapt")
        if self.lookup < 0:
            raise UserError(f"lookup must be >= 0 (copied drafts per pass; 0: none), got {self.lookup}")
        if self.lookup and self.drafting == "tree":
            raise UserError("lookup drafts join linear or quadratic drafting, not tree: use --drafting quadratic "
                            "--lookup N, or drop --lookup")
        if self.lookup and self.drafting != "lookup" and self.temperature > 0:
            raise UserError("lookup beside mask drafts verifies greedy decoding only: send temperature 0, or "
                            "sample with drafting lookup alone")

    def validate(self) -> DecodeConfig:
        STRATEGIES.check(self.mode)
        if self.k < 1:
            raise UserError(f"k must be >= 1, got {self.k}")
        if self.k_max is not None and self.k_max < 2:
            raise UserError("k_max must be >= 2 (it counts the next token plus at least one mask slot), "
                            f"got {self.k_max}")
        if self.tau is not None and not 0.0 < self.tau <= 1.0:
            raise UserError(f"tau must lie in (0, 1], got {self.tau}")
        CONFIDENCE.check(self.confidence)
        if self.drafting not in DRAFTING:
            raise UserError(f"unknown drafting {self.drafting!r}: choose one of {', '.join(DRAFTING)}")
        if self.drafting == "tree":
            try:
                widths = [int(w) for w in self.tree_widths.split(",")]
            except ValueError:
                widths = [0]
            if not widths or min(widths) < 1:
                raise UserError(f"tree_widths must be positive integers like 2,2, got {self.tree_widths!r}")
            if self.temperature > 0:
                raise UserError("tree drafting verifies greedy decoding only: use --drafting linear or quadratic "
                                "to sample with --temperature")
        self._check_lookup()
        WINDOWS.check(self.window)
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise UserError("temperature must be >= 0, top_p in (0, 1] and top_k >= 0")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        return self


def _drafting(spec: str, after_plus: bool = False) -> tuple[str, int]:  # (drafting, lookup) of quadratic+lookup
    drafting, plus, extra = spec.partition("+")  # after a `+`, `lookup` alone means linear + copies
    if after_plus and drafting == "lookup" and not plus:
        return "linear", LOOKUP_TOKENS
    if plus and (extra != "lookup" or drafting == "lookup"):
        raise ValueError
    return drafting, LOOKUP_TOKENS if plus else 0


def mode_grammar() -> str:
    """How a decoding mode is written as one string (CLI --modes, the server's `mode` field), from the registries."""
    return (f"ntp, static:K, confadapt[+quadratic|+lookup|+quadratic+lookup][:TAU[:{'|'.join(CONFIDENCE.names())}]]"
            f"[@K] or verified[:{'|'.join(DRAFTING)}[+lookup][:{'|'.join(WINDOWS.names())}]][@K]")


BACKEND_ENV = "MTPLM_BACKEND"  # what --backend auto means when set (e.g. eager in a test run)


@dataclass
class Limits:
    """The server's bounds on one request (`mtplm serve` options override them)."""

    max_tokens: int = 4096  # largest max_tokens accepted
    default_max_tokens: int = 256  # chat requests that give none (completions default to OpenAI's 16)
    context: int = 8192  # prompt + max_tokens must fit (further capped by the model's own context)


def parse_mode(spec: str, window: str = "adaptive", k_max: int | None = None,
               confidence: str = "top1") -> DecodeConfig:
    """A decoding mode written as one string (mode_grammar()), e.g. `confadapt:0.9@8` or `verified:tree`.

    Parts left out keep DecodeConfig's defaults (a confadapt tau or k_max left out: the checkpoint's
    calibrated values); `window`, `k_max` and `confidence` are the caller's defaults for those parts.
    """
    body, at, k = spec.strip().partition("@")
    kind, _, rest = body.partition(":")
    kind, plus, drafts = kind.partition("+")  # confadapt+quadratic[+lookup]: its leftover slots verified
    value, _, measure = rest.partition(":")
    try:
        k_max = int(k) if at else k_max
        if kind in ("ntp", "plain") and not rest + plus:
            cfg = DecodeConfig(mode="ntp")
        elif kind == "static" and not measure + plus:
            cfg = DecodeConfig(mode="static", k=int(value) if value else DecodeConfig.k)
        elif kind == "confadapt" and drafts != "linear":
            drafting, lookup = _drafting(drafts or "linear", bool(plus))
            cfg = DecodeConfig(mode="confadapt", tau=float(value) if value else None, k_max=k_max,
                               confidence=measure or confidence, drafting=drafting, lookup=lookup)
        elif kind == "verified" and not plus:
            drafting, lookup = _drafting(value or "linear")
            cfg = DecodeConfig(mode="verified", k_max=k_max, drafting=drafting, window=measure or window, lookup=lookup)
        else:
            raise ValueError
        return cfg.validate()
    except (ValueError, UserError):
        raise UserError(f"bad decoding mode {spec!r}: use {mode_grammar()}") from None


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"  # registry name, HF directory or .gguf file
    out: str = "runs/mtp"
    method: str = "mask"  # mask (one <mtp> token, doc 000) | heads (K-1 heads on a frozen trunk, doc 002)
    trainable: str = "gated-lora"  # gated-lora | lora | full
    objective: str = "hard"  # hard (teacher argmax) | soft (teacher KL) | ground-truth (offline baseline)
    warmup_ground_truth_steps: int = 0  # doc 000's stage 1: ground-truth CE before the distillation stage
    ntp_weight: float = 0.0  # extra ground-truth NTP loss on prefix positions ("prefix loss")
    entropy_weight: float = 0.0  # + weight * mean student entropy at supervised slots
    k_max: int = 16  # k ~ U[2, k_max] each step (the paper's; the shipped SmolLM2 recipe uses 8)
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_targets: str = "all"  # projections that train: all | attn | mlp | a comma list such as q_proj,v_proj
    lr: float = 1e-3
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant
    weight_decay: float = 0.0
    steps: int = 600
    batch_size: int = 8
    seq_len: int = 320
    slots_per_seq: int = 96  # mask-slot budget per sequence and step (gated-lora layout)
    ground_truth_cache_gb: float = 8.0  # gated-lora: keep the texts' base KV in RAM up to this size
    region_width: int = 32  # packed layout (full / lora): tokens per region, ground truth + mask slots
    dtype: str = "bf16"  # bf16 | fp32 compute (trainable weights stay float32)
    # one source (self:<prompt set> | sharegpt | gsm8k | humaneval | jsonl:<path> | text:<path>) or a mix of them
    # with weights, e.g. self:mixed=0.3,sharegpt=0.5,gsm8k=0.2 (train/mix.py)
    data: str = "self:mixed"
    data_texts: int = 0  # distinct texts in the mix (0: self_gen_prompts)
    self_gen_prompts: int = 1200
    self_gen_cache: str = ""  # file of self-generated answers, by prompt id ("": selfgen.jsonl in out)
    self_gen_max_new_tokens: int = 256
    self_gen_batch: int = 16
    # hf: batched `generate` of the bf16 model | llama-server: its f16 GGUF on the installed llama-server,
    # self_gen_batch slots decoded together, continuously batched (scripts/install_llama_server.sh)
    self_gen_engine: str = "hf"
    val_fraction: float = 0.05
    val_every: int = 50
    log_every: int = 10
    save_every: int = 100
    tau: float = 0.9  # threshold for the validation tokens/forward estimate
    # the decode predictor (train/predict.py): decoding simulated on held-out own answers at each validation
    predict_modes: str = "verified,verified:quadratic,confadapt"  # bench mode strings (config.parse_mode)
    predict_texts: int = 16  # held-out texts it reads (0: off)
    predict_max_new_tokens: int = 128  # answers cut where the bench stops decoding
    pass_cost: str = "measure"  # pass-cost curve for the served speedup: measure (eager, at start) | a JSON file | ""
    seed: int = 0
    threads: int = 0  # torch threads; 0 = leave torch's default
    device: str = "auto"  # auto (this rank's GPU when CUDA is available, else CPU) | cpu | cuda
    parallel: str = "ddp"  # under torchrun: ddp (replicas) | fsdp (sharded; trainable=full only)
    resume: str = ""  # "" fresh start | auto (out/train_state if present) | a train_state folder
    # method=heads (headtrain.py); k_max is K, the heads are 2..K
    head_form: str = "medusa"  # medusa (residual MLP) | sequential (DeepSeek-V3-style chain) | eagle3
    head_alpha: str = "decay"  # loss weights: decay (0.9^k) | a number r (r^k) | deepseek (lambda/D, 0.3 -> 0.1)
    head_lr: str = "distance"  # distance (heads 4-6 x0.8, 7-9 x0.5, ...) | flat
    curriculum: bool = True  # dynamic masking: supervise heads s..K, s ~ U[1, s_hi], s_hi: K -> 1
    curriculum_fraction: float = 0.5  # share of training over which s_hi falls to 1
    consistency_weight: float = 0.0  # lambda of MSE(E_t[head_k], E_t+1[head_k-1])
    far_heads_bf16: bool = True  # heads 5+ compute their logits in bfloat16
    head_window: int = 64  # response rows per sequence and step (heads read one row each); 0 = whole rows
    # head_form=eagle3 (heads/eagle3.py): K-1 drafting steps unrolled in training; whole rows, not windows
    eagle3_layers: str = "auto"  # target layers whose inputs it reads: auto (2, L//2, L-3, as speculators) | a,b,c
    draft_vocab: int = 32000  # its vocabulary: this many of the target tokens the training labels use most

    def validate(self) -> TrainConfig:
        if self.method not in METHODS:
            raise UserError(f"unknown method {self.method!r}: choose one of {', '.join(METHODS)}")
        HEAD_FORMS.check(self.head_form)
        if self.head_alpha not in ("decay", "deepseek"):
            try:
                if not 0.0 < float(self.head_alpha) <= 1.0:
                    raise ValueError
            except ValueError:
                raise UserError("head_alpha must be decay, deepseek or a number in (0, 1], "
                                f"got {self.head_alpha!r}") from None
        if self.head_lr not in ("distance", "flat"):
            raise UserError(f"head_lr must be distance or flat, got {self.head_lr!r}")
        if self.draft_vocab < 1:
            raise UserError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if not 0.0 < self.curriculum_fraction <= 1.0 or self.consistency_weight < 0:
            raise UserError("curriculum_fraction must lie in (0, 1] and consistency_weight be >= 0")
        TRAINABLE.check(self.trainable)
        if self.ntp_weight and (self.method != "mask" or not TRAINABLE.get(self.trainable).trains_real_rows):
            raise UserError("ntp_weight trains the real rows: use method=mask with trainable=lora or full, not "
                            f"method={self.method} trainable={self.trainable}")  # heads: the trunk is frozen
        OBJECTIVES.check(self.objective)
        if self.k_max < 2:
            raise UserError(f"k_max must be >= 2 (the next token plus at least one mask slot), got {self.k_max}")
        if self.region_width <= self.k_max:
            raise UserError(f"region_width ({self.region_width}) must exceed k_max ({self.k_max})")
        if not 0.0 < self.tau <= 1.0:
            raise UserError(f"tau must lie in (0, 1], got {self.tau}")
        if self.steps < 0 or self.batch_size < 1 or self.seq_len < 2 * self.k_max:
            raise UserError("steps must be >= 0, batch_size >= 1 and seq_len >= 2 * k_max")
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"dtype must be bf16 or fp32, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise UserError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.self_gen_engine not in SELF_GEN_ENGINES:
            raise UserError(f"self_gen_engine must be one of {', '.join(SELF_GEN_ENGINES)}, "
                            f"got {self.self_gen_engine!r}")
        if self.parallel not in ("ddp", "fsdp"):
            raise UserError(f"parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.parallel == "fsdp" and self.trainable != "full":
            raise UserError(f"parallel=fsdp shards a full fine-tune; trainable={self.trainable} trains small "
                            "adapters that fit every device: use parallel=ddp")
        if self.save_every < 1 or self.log_every < 1 or self.val_every < 1:
            raise UserError("save_every, log_every and val_every must be >= 1")
        if self.data_texts < 0 or self.predict_texts < 0 or self.predict_max_new_tokens < 1:
            raise UserError("data_texts and predict_texts must be >= 0, predict_max_new_tokens >= 1")
        lora_targets(self.lora_targets)
        return self  # the data mix and the replayed modes are train's rules: train.checks checks them


LORA_GROUPS = {"all": DEFAULT_TARGETS, "attn": DEFAULT_TARGETS[:4], "mlp": DEFAULT_TARGETS[4:]}


def lora_targets(spec: str) -> tuple[str, ...]:
    """The projections a `lora_targets` setting names (all | attn | mlp | a comma list of projection names)."""
    names = LORA_GROUPS.get(spec.strip()) or tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in DEFAULT_TARGETS]
    if unknown or not names:
        raise UserError(f"lora_targets {spec!r}: use all, attn, mlp or a comma list of {', '.join(DEFAULT_TARGETS)}")
    return names


def override(cfg, pairs: list[str]):
    """Return a copy of dataclass `cfg` with `key=value` strings applied; unknown keys are errors."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    updates = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in fields:
            known = ", ".join(sorted(fields))
            raise UserError(f"unknown setting {pair!r}: write key=value with key one of {known}")
        updates[key] = _parse(raw.strip(), getattr(cfg, key), key)
    return dataclasses.replace(cfg, **updates)


def load_train_config(path: Path | None, pairs: list[str]) -> TrainConfig:
    """TrainConfig defaults <- a TOML file (flat table of settings) <- key=value strings; unknown keys are errors."""
    cfg = TrainConfig()
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise UserError(f"cannot read config {path}: {exc}") from None
        nested = [key for key, value in table.items() if isinstance(value, (dict, list))]
        if nested:
            raise UserError(f"config {path}: {', '.join(nested)} must be plain settings (key = value), "
                            "not tables or lists")
        try:
            cfg = override(cfg, [f"{key}={value}" for key, value in table.items()])
        except UserError as exc:
            raise UserError(f"config {path}: {exc}") from None
    return override(cfg, pairs)


def to_toml(cfg) -> str:
    """A dataclass of scalar settings as TOML that `load_train_config` reads back to an equal config."""
    lines = []
    for name, value in dataclasses.asdict(cfg).items():
        if isinstance(value, bool):
            lines.append(f"{name} = {str(value).lower()}")
        elif isinstance(value, (int, float)):
            lines.append(f"{name} = {value!r}")
        else:
            lines.append(f"{name} = {json.dumps(str(value))}")  # a JSON string is a valid TOML basic string
    return "\n".join(lines) + "\n"


def _parse(raw: str, current, key: str):
    try:
        if isinstance(current, bool):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes")
        if isinstance(current, int):
            return int(raw)
        if isinstance(current, float):
            return float(raw)
    except ValueError:
        raise UserError(f"setting {key}={raw!r}: expected a {type(current).__name__}") from None
    if current is None:
        if raw.lower() == "none":
            return None
        for cast in (int, float):
            try:
                return cast(raw)
            except ValueError:
                pass
    return raw


as_dict = dataclasses.asdict  # a config as a JSON-ready dict (training logs and checkpoints)
__all__ = ["DecodeConfig", "TrainConfig", "Thresholds", "Limits", "mode_grammar", "BACKEND_ENV", "override",
           "load_train_config", "to_toml", "as_dict", "field"]
