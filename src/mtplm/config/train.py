"""Training records: every conversion setting (TrainConfig) with its default, and the LoRA projections."""

from __future__ import annotations

from dataclasses import dataclass

from mtplm.errors import UserError
from mtplm.registry import HEAD_FORMS, OBJECTIVES, TRAINABLE

DEFAULT_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)  # LoRA wraps these
METHODS = ("mask", "heads")
DTYPES = ("fp32", "bf16")
# what decoding loads: also "gguf" (a GGUF's linear weights as they are, the rest bf16) and "auto" (that where
# the model comes from a GGUF whose block types the kernels run, else bf16)
DECODE_DTYPES = ("auto", "gguf", *DTYPES)
SCHEDULES = ("cosine", "constant")  # the learning rate after warm-up: cosine to 0.1x, or constant
SELF_GEN_ENGINES = (
    "hf",
    "llama-server",
)  # TrainConfig.self_gen_engine: what generates the model's own answers


@dataclass
class TrainConfig:
    model: str = "smollm2-135m"  # registry name, HF directory or .gguf file
    out: str = "runs/mtp"
    method: str = "mask"  # mask (one <mtp> token, self-distilled) | heads (K-1 heads on a frozen trunk)
    trainable: str = "gated-lora"  # gated-lora | lora | full
    objective: str = "hard"  # hard (teacher argmax) | soft (teacher KL) | ground-truth (offline baseline)
    warmup_ground_truth_steps: int = 0  # stage 1: ground-truth CE before the distillation stage
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
    # one source (self:<prompt set> | sharegpt | gsm8k | humaneval | jsonl:<path> | text:<path>) or a mix
    # of them with weights, e.g. self:mixed=0.3,sharegpt=0.5,gsm8k=0.2 (train/mix.py)
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
    pass_cost: str = (
        "measure"  # pass-cost curve for the served speedup: measure (eager, at start) | a JSON file | ""
    )
    seed: int = 0
    threads: int = 0  # torch threads; 0 = leave torch's default
    device: str = "auto"  # auto (this rank's GPU when CUDA is available, else CPU) | cpu | cuda
    parallel: str = "ddp"  # under torchrun: ddp (replicas) | fsdp (sharded; trainable=full only)
    resume: str = ""  # "" fresh start | auto (out/train_state if present) | a train_state folder
    # method=heads (headtrain.py); k_max is K, the heads are 2..K
    head_form: str = "medusa"  # medusa (residual MLP) | sequential (DeepSeek-V3-style chain) | eagle3
    head_alpha: str = (
        "decay"  # loss weights: decay (0.9^k) | a number r (r^k) | deepseek (lambda/D, 0.3 -> 0.1)
    )
    head_lr: str = "distance"  # distance (heads 4-6 x0.8, 7-9 x0.5, ...) | flat
    curriculum: bool = True  # dynamic masking: supervise heads s..K, s ~ U[1, s_hi], s_hi: K -> 1
    curriculum_fraction: float = 0.5  # share of training over which s_hi falls to 1
    consistency_weight: float = 0.0  # lambda of MSE(E_t[head_k], E_t+1[head_k-1])
    far_heads_bf16: bool = True  # heads 5+ compute their logits in bfloat16
    head_window: int = 64  # response rows per sequence and step (heads read one row each); 0 = whole rows
    # head_form=eagle3 (heads/eagle3.py): K-1 drafting steps unrolled in training; whole rows, not windows
    eagle3_layers: str = (
        "auto"  # target layers whose inputs it reads: auto (2, L//2, L-3, as speculators) | a,b,c
    )
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
                raise UserError(
                    f"head_alpha must be decay, deepseek or a number in (0, 1], got {self.head_alpha!r}"
                ) from None
        if self.head_lr not in ("distance", "flat"):
            raise UserError(f"head_lr must be distance or flat, got {self.head_lr!r}")
        if self.draft_vocab < 1:
            raise UserError(f"draft_vocab must be >= 1, got {self.draft_vocab}")
        if not 0.0 < self.curriculum_fraction <= 1.0 or self.consistency_weight < 0:
            raise UserError("curriculum_fraction must lie in (0, 1] and consistency_weight be >= 0")
        TRAINABLE.check(self.trainable)
        if self.ntp_weight and (self.method != "mask" or not TRAINABLE.get(self.trainable).trains_real_rows):
            raise UserError(
                "ntp_weight trains the real rows: use method=mask with trainable=lora or full, not "
                f"method={self.method} trainable={self.trainable}"
            )  # heads: the trunk is frozen
        OBJECTIVES.check(self.objective)
        if self.k_max < 2:
            raise UserError(
                f"k_max must be >= 2 (the next token plus at least one mask slot), got {self.k_max}"
            )
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
            raise UserError(
                f"self_gen_engine must be one of {', '.join(SELF_GEN_ENGINES)}, got {self.self_gen_engine!r}"
            )
        if self.parallel not in ("ddp", "fsdp"):
            raise UserError(f"parallel must be ddp or fsdp, got {self.parallel!r}")
        if self.parallel == "fsdp" and self.trainable != "full":
            raise UserError(
                f"parallel=fsdp shards a full fine-tune; trainable={self.trainable} trains small "
                "adapters that fit every device: use parallel=ddp"
            )
        if self.save_every < 1 or self.log_every < 1 or self.val_every < 1:
            raise UserError("save_every, log_every and val_every must be >= 1")
        if self.data_texts < 0 or self.predict_texts < 0 or self.predict_max_new_tokens < 1:
            raise UserError("data_texts and predict_texts must be >= 0, predict_max_new_tokens >= 1")
        lora_targets(self.lora_targets)
        return self  # the data mix and the replayed modes are train's rules: train.checks checks them


LORA_GROUPS = {"all": DEFAULT_TARGETS, "attn": DEFAULT_TARGETS[:4], "mlp": DEFAULT_TARGETS[4:]}


def lora_targets(spec: str) -> tuple[str, ...]:
    """The projections a `lora_targets` setting names (all | attn | mlp | a comma list of projection
    names)."""
    names = LORA_GROUPS.get(spec.strip()) or tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in DEFAULT_TARGETS]
    if unknown or not names:
        raise UserError(
            f"lora_targets {spec!r}: use all, attn, mlp or a comma list of {', '.join(DEFAULT_TARGETS)}"
        )
    return names
