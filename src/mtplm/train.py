"""train(cfg): convert a causal LM into a mask-token multi-token predictor by online self-distillation.

One loop, steps in order: draw k ~ U[2, k_max] and the regions; student forward; student-forced teacher
forward (hard labels by default); loss; backward; optimiser and schedule step; log; validate; save.
"""

from __future__ import annotations

import copy
import json
import math
import random
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import lora
from .config import TrainConfig, as_dict
from .data import batches, collate, load_samples
from .losses import entropy, hard_teacher_loss, slot_statistics, soft_teacher_loss
from .masks import interleaved_regions, random_regions
from .model import MTPModel
from .data import row_ids
from .plots import training_curves
from .objective import GroundTruthStore, SlotOutputs, TokenBatch, cached_slots, packed_slots


class Trainer:
    """The model being converted, its teacher and optimiser; `step` and `validate` are the loop's parts."""

    def __init__(self, cfg: TrainConfig, model: MTPModel) -> None:
        self.cfg, self.model = cfg, model
        self.rng = random.Random(cfg.seed)
        self.regions_gen = torch.Generator().manual_seed(cfg.seed)
        self._frozen_teacher = None
        self.store: GroundTruthStore | None = None
        model.meta.trainable = cfg.trainable
        if cfg.trainable == "gated-lora":
            model.attach_gated_lora(cfg.lora_rank, cfg.lora_alpha)
            params = lora.adapter_parameters(model.hf)
        elif cfg.trainable == "lora":
            params = _attach_peft_lora(model, cfg)
        else:
            self._frozen_teacher = MTPModel(copy.deepcopy(model.hf).to(torch.bfloat16 if cfg.dtype == "bf16"
                                                                        else torch.float32).eval(),
                                            model.tokenizer, model.meta)
            self._frozen_teacher.hf.requires_grad_(False)
            params = list(model.hf.parameters())
        for p in model.hf.parameters():
            p.requires_grad_(False)
        for p in params:
            p.requires_grad_(True)
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)

    def _lr_factor(self, step: int) -> float:
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def cache_ground_truth(self, samples: list, progress: bool) -> None:
        """Gated LoRA: run every training text through the base model once and keep its KV (if it fits)."""
        store, budget = GroundTruthStore(), self.cfg.ground_truth_cache_gb * 2**30
        for index, sample in enumerate(tqdm(samples, desc="cache ground truth", unit="text", disable=not progress)):
            store.add(self.model, index, row_ids(sample, self.cfg.seq_len)[0])
            if index == 7:
                per_token = _nbytes(store) / sum(s.hidden.shape[0] for s in store.states.values())
                needed = per_token * sum(len(row_ids(x, self.cfg.seq_len)[0]) for x in samples)
                if needed > budget:
                    tqdm.write(f"ground-truth KV would take {needed / 2**30:.1f} GB > ground_truth_cache_gb: "
                               "recomputing it every step instead")
                    return
        self.store = store

    @contextmanager
    def teacher(self):
        if self._frozen_teacher is not None:
            yield self._frozen_teacher
        else:
            with self.model.adapters_disabled() as base:
                yield base

    def forward(self, batch: TokenBatch, k: int, objective: str, offset: int | None = None) -> SlotOutputs:
        cfg, use_teacher = self.cfg, objective != "ground-truth"
        if cfg.trainable == "gated-lora":
            num = max(1, cfg.slots_per_seq // (k - 1))
            regions = random_regions(batch.starts, batch.lengths, k, num, self.regions_gen)
            store = self.store if batch.indices is not None else None
            return cached_slots(self.model, batch, regions, use_teacher, store)
        if offset is None:
            offset = self.rng.randrange(cfg.region_width - (k - 1))
        regions = interleaved_regions(batch.starts, batch.lengths, k, cfg.region_width, offset, batch.ids.shape[1])
        with _autocast(self.cfg):
            return packed_slots(self.model, self.teacher, batch, regions, use_teacher, cfg.ntp_weight > 0)

    def loss(self, out: SlotOutputs, batch: TokenBatch, objective: str) -> torch.Tensor:
        cfg, first = self.cfg, out.first_trainable
        valid = out.valid[:, :, first:]
        student = out.student_logits[:, :, first:][valid]  # [N, V]
        if objective == "soft":
            loss = soft_teacher_loss(student, out.teacher_logits[:, :, first:][valid])
        else:
            loss = hard_teacher_loss(student, out.labels[:, :, first:][valid])
        if cfg.entropy_weight:
            loss = loss + cfg.entropy_weight * entropy(student)
        if cfg.ntp_weight and out.prefix_logits is not None:
            real = torch.arange(batch.ids.shape[1] - 1) < (batch.lengths - 1).unsqueeze(1)  # [B, L-1]
            ntp = F.cross_entropy(out.prefix_logits[:, :-1][real], batch.ids[:, 1:][real])
            loss = loss + cfg.ntp_weight * ntp
        return loss

    def step(self, batch: TokenBatch, step: int) -> dict:
        cfg = self.cfg
        k = self.rng.randint(2, cfg.k_max)
        objective = "ground-truth" if step < cfg.warmup_ground_truth_steps else cfg.objective
        self.model.hf.train()
        out = self.forward(batch, k, objective)
        loss = self.loss(out, batch, objective)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        keep = out.valid.any(-1)  # [B, M] regions with at least one supervised prediction
        stats = slot_statistics(out.student_logits.detach()[keep], out.labels[keep], out.valid[keep], cfg.tau)
        return {"loss": float(loss.detach()), "k": k, "lr": self.scheduler.get_last_lr()[0], **stats}

    @torch.no_grad()
    def validate(self, val_batches: list[TokenBatch]) -> dict:
        """Teacher agreement, confidence and estimated tokens/forward at k = k_max on held-out text."""
        self.model.hf.eval()
        saved = self.regions_gen.get_state()
        self.regions_gen.manual_seed(12345)  # the same regions at every validation
        logits, labels, valid = [], [], []
        for batch in val_batches:
            out = self.forward(batch, self.cfg.k_max, "hard", offset=0)
            keep = out.valid.any(-1)  # [B, M]
            logits.append(out.student_logits[keep]), labels.append(out.labels[keep]), valid.append(out.valid[keep])
        self.regions_gen.set_state(saved)
        return slot_statistics(torch.cat(logits), torch.cat(labels), torch.cat(valid), self.cfg.tau)

    def save(self, run_dir: Path, final: bool) -> Path:
        model = self.model
        if self.cfg.trainable == "lora":
            merged = MTPModel(copy.deepcopy(model.hf).merge_and_unload(), model.tokenizer, model.meta)
            return merged.save(run_dir / "checkpoint")
        if self.cfg.trainable == "gated-lora":
            model.save_delta(run_dir / "delta", self.cfg.model)
            if not final:
                return run_dir / "delta"
        return model.save(run_dir / "checkpoint")


class MetricsLog:
    """A run's metrics.jsonl: one JSON object per line, stamped with the seconds since the run started."""

    def __init__(self, run_dir: Path, started: float) -> None:
        self.file, self.started = open(run_dir / "metrics.jsonl", "a"), started

    def record(self, entry: dict) -> None:
        self.file.write(json.dumps({**entry, "elapsed_s": round(time.perf_counter() - self.started, 1)}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def train(cfg: TrainConfig, progress: bool = True) -> Path:
    from .assets import model_identity, resolve_model

    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.method == "heads":
        from .headtrain import train_heads

        return train_heads(cfg, progress)
    torch.manual_seed(cfg.seed)
    run_dir = Path(cfg.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(as_dict(cfg), indent=2) + "\n")
    compute = "fp32" if cfg.trainable == "full" else cfg.dtype  # full fine-tune keeps fp32 master weights
    model = MTPModel.load(cfg.model, dtype=compute)
    samples = load_samples(cfg.data, model.tokenizer, model.hf, run_dir, cfg)
    model.add_mask_token(cfg.k_max, model_identity(resolve_model(cfg.model)), seed=cfg.seed)
    model.meta.thresholds = {"tau": cfg.tau, "confidence": "top1", "k_max": cfg.k_max}

    pad = model.tokenizer.pad_token_id if model.tokenizer.pad_token_id is not None else model.tokenizer.eos_token_id
    num_val = max(1, int(len(samples) * cfg.val_fraction))
    train_samples, val_samples = samples[:-num_val], samples[-num_val:]
    if not train_samples:
        train_samples = samples
    val_batches = [collate(val_samples[i : i + cfg.batch_size], cfg.seq_len, pad)
                   for i in range(0, len(val_samples), cfg.batch_size)]
    stream = batches(train_samples, min(cfg.batch_size, len(train_samples)), cfg.seq_len, pad, cfg.seed)

    trainer = Trainer(cfg, model)
    if cfg.trainable == "gated-lora":
        trainer.cache_ground_truth(train_samples, progress)
    started = time.perf_counter()
    log = MetricsLog(run_dir, started)
    record = log.record
    val = trainer.validate(val_batches)
    record({"step": 0, "val": val})
    bar = tqdm(range(cfg.steps), desc="train", unit="step", disable=not progress)
    for step in bar:
        stats = trainer.step(next(stream), step)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            record({"step": step + 1, **stats})
        agree = stats["agreement"]
        bar.set_postfix(loss=f"{stats['loss']:.3f}", slot1=f"{agree[1]:.2f}" if len(agree) > 1 else "-",
                        val_tpf=f"{val['est_tokens_per_forward']:.2f}")
        if (step + 1) % cfg.val_every == 0 or step == cfg.steps - 1:
            val = trainer.validate(val_batches)
            record({"step": step + 1, "val": val})
            tqdm.write(_describe(step + 1, val, cfg.tau))
        if (step + 1) % cfg.save_every == 0 and step != cfg.steps - 1:
            trainer.save(run_dir, final=False)
    model.meta.training = {"config": as_dict(cfg), "steps": cfg.steps, "samples": len(samples),
                           "cpu_time_s": round(time.perf_counter() - started, 1), "final_val": val}
    trainer.save(run_dir, final=True)  # the trained weights are safe before anything else can fail
    check = decode_check(model, val_samples[:8], cfg)
    record({"step": cfg.steps, "decode_check": check})
    tqdm.write(f"[decode check] ConfAdapt tau={cfg.tau}, k_max={cfg.k_max} on {check['prompts']} held-out prompts: "
               f"{check['tokens_per_forward']:.2f} tokens/forward, {check['identical']:.0%} identical to plain greedy")
    model.meta.training["decode_check"] = check
    log.close()
    training_curves(run_dir)
    return trainer.save(run_dir, final=True)


def decode_check(model: MTPModel, samples: list, cfg: TrainConfig, max_new_tokens: int = 96) -> dict:
    """Real ConfAdapt decoding on held-out prompts: tokens/forward and agreement with plain greedy."""
    from .config import DecodeConfig
    from .decode import generate

    model.hf.eval()
    tokens = forwards = identical = 0
    for sample in samples:
        fast = generate(model, sample.prompt_ids, DecodeConfig(mode="confadapt", k_max=cfg.k_max, tau=cfg.tau,
                                                                max_new_tokens=max_new_tokens))
        plain = generate(model, sample.prompt_ids, DecodeConfig(mode="ntp", max_new_tokens=max_new_tokens))
        tokens, forwards, identical = tokens + len(fast.tokens), forwards + fast.forwards, identical + (fast.tokens == plain.tokens)
    return {"prompts": len(samples), "tokens_per_forward": tokens / max(1, forwards),
            "identical": identical / max(1, len(samples))}


def _describe(step: int, val: dict, tau: float) -> str:
    agree = " ".join(f"{a:.2f}" for a in val["agreement"][:6])
    conf = " ".join(f"{c:.2f}" for c in val["confidence"][:6])
    return (f"[val step {step}] agreement by slot {agree} | confidence {conf} | est tokens/forward "
            f"@tau={tau}: {val['est_tokens_per_forward']:.2f} | verified est {val['est_verified_per_forward']:.2f}")


def _nbytes(store: GroundTruthStore) -> int:
    return sum(t.numel() * t.element_size() for s in store.states.values()
               for t in [s.hidden, *[x for kv in s.layers for x in kv]])


def _attach_peft_lora(model: MTPModel, cfg: TrainConfig) -> list[torch.nn.Parameter]:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(lora.DEFAULT_TARGETS),
                        lora_dropout=0.0, bias="none")
    model.hf = get_peft_model(model.hf, config)
    return [p for n, p in model.hf.named_parameters() if "lora_" in n]


@contextmanager
def _autocast(cfg: TrainConfig):
    if cfg.trainable == "full" and cfg.dtype == "bf16":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield
    else:
        yield
