"""One TRL ``GRPOTrainer`` run for ``vs_trl.py``, in a process of its own.

    python benchmarks/_trl_runner.py JOB_JSON RESULT_PATH

Same weights, tokenizer, prompts (in the same order), reward and hyper-parameters as the
flowrl run of the same job. TRL's defaults that differ from the job are overridden on
purpose (see NOTES.md): ``bf16`` (on by default), ``beta`` (0 by default), ``loss_type``
("dapo" by default), ``gradient_checkpointing`` (on by default), ``shuffle_dataset`` (on) and
``use_bias_correction_kl`` (on by default: the k3 term times the importance ratio).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def prompt_list(job: dict[str, Any]) -> list[str]:
    """The prompts flowrl's PromptSource gives for steps 0..steps-1, in order."""
    from flowrl.data import PromptSource

    source = PromptSource(
        "builtin:digits", batch_size=job["prompts_per_step"], seed=job["seed"], base_dir=Path.cwd()
    )
    return [example.prompt for step in range(job["steps"]) for example in source.next_batch(step)]


def grpo_config(job: dict[str, Any], output_dir: str) -> Any:
    from trl import GRPOConfig

    num_completions = job["prompts_per_step"] * job["num_generations"]
    # Micro-batches: ``trl_micro_batch`` completions per forward/backward pass (and per
    # reference pass), gradients accumulated over the step's passes; one generate() call
    # still produces the whole step's completions (steps_per_generation = accumulation).
    micro = job.get("trl_micro_batch") or num_completions
    if num_completions % micro:
        raise ValueError(f"trl_micro_batch {micro} must divide the {num_completions} completions of a step")
    accumulation = num_completions // micro
    extra: dict[str, Any] = {}
    if job.get("trl_cache"):
        extra["cache_implementation"] = job["trl_cache"]
    if job.get("trl_liger"):
        extra["use_liger_kernel"] = True
    return GRPOConfig(
        output_dir=output_dir,
        max_steps=job["steps"],
        seed=job["seed"],
        # The batch: 4 prompts x 8 completions, one optimizer step per generation, one pass.
        per_device_train_batch_size=micro,  # counts completions, not prompts
        num_generations=job["num_generations"],
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_iterations=1,
        shuffle_dataset=False,
        max_completion_length=job["max_new_tokens"],
        temperature=job["temperature"],
        top_p=job["top_p"],
        top_k=0,
        # Optimizer: AdamW, constant learning rate, no warm-up.
        learning_rate=job["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=job["betas"][0],
        adam_beta2=job["betas"][1],
        weight_decay=job["weight_decay"],
        max_grad_norm=job["max_grad_norm"],
        # Loss: PPO clip, k3 KL to a reference model, token mean over the batch.
        epsilon=job["epsilon"],
        beta=job["beta"],
        # TRL 1.16 defaults to multiplying the k3 term by the importance ratio, whose gradient
        # is not zero even on-policy (~0.6 % off flowrl's gradient on one batch, and the KL
        # grows about half as fast); off, the KL term is plain k3 as in flowrl.
        use_bias_correction_kl=False,
        loss_type="bnpo",
        scale_rewards="group",
        # Machine: fp32 on the CPU or the job's dtype on the GPU; plain generate().
        bf16=job.get("dtype") == "bf16",
        fp16=False,
        use_cpu=job.get("device", "cpu") == "cpu",
        use_vllm=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "bfloat16" if job.get("dtype") == "bf16" else "float32"},
        # Quiet: no trackers, no checkpoints, no progress bar; log every step.
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        **extra,
    )


def run_trl(job: dict[str, Any]) -> dict[str, Any]:
    import datasets
    import torch
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from flowrl.backends.builtin import builtin_model_dir
    from flowrl.rewards import REWARD_FUNCTIONS

    if job.get("trl_threads"):
        torch.set_num_threads(int(job["trl_threads"]))
    model_dir = str(builtin_model_dir(job["model"]))
    prompts = prompt_list(job)
    max_new_tokens = job["max_new_tokens"]
    group = job["num_generations"]
    digit_match = REWARD_FUNCTIONS["digits"]
    per_call: list[dict[str, Any]] = []

    def digits(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **_: Any) -> list[float]:
        scores = digit_match(completions=list(completions), max_new_tokens=max_new_tokens)
        per_call.append({
            "reward_mean": sum(scores) / len(scores),
            "completion_tokens": sum(len(ids) for ids in completion_ids),  # eos included, as flowrl
            "prompts": list(prompts[::group]),
        })
        return scores

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.begin_s: list[float] = []
            self.end_s: list[float] = []
            self.logs: list[dict[str, float]] = []
            self.first_step_start_unix: float | None = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begin_s.append(time.perf_counter())
            if len(self.begin_s) == 1:
                self.first_step_start_unix = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.end_s.append(time.perf_counter())

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs:
                self.logs.append({k: float(v) for k, v in logs.items() if isinstance(v, (int, float))})

    clock = StepClock()
    output_dir = tempfile.mkdtemp(prefix="trl-vs-flowrl-")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    peft: dict[str, Any] = {}
    if job.get("lora_rank"):
        from peft import LoraConfig

        # as flowrl's lora: every linear layer of the decoder layers, alpha 2 x rank, no dropout;
        # TRL then takes the reference from the model with its adapters disabled
        rank = int(job["lora_rank"])
        peft["peft_config"] = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                                         task_type="CAUSAL_LM")
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=digits,
        args=grpo_config(job, output_dir),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[clock],
        **peft,
    )
    # disable_tqdm makes transformers print every log dict; StepClock keeps them instead.
    trainer.remove_callback(PrinterCallback)
    # Generation time per step: wrap the policy's generate() (TRL calls it once per step).
    generate_s: list[float] = []
    original_generate = trainer.model.generate

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed_generate(*args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = original_generate(*args, **kwargs)
        sync()
        generate_s.append(time.perf_counter() - t0)
        return out

    trainer.model.generate = timed_generate
    # Reference forward time per step (TRL calls it with ref_model once per generation batch).
    reference_s: list[float] = []
    original_logps = trainer._get_per_token_logps_and_entropies

    adapted = [layer for layer in trainer.model.modules() if hasattr(layer, "lora_A") and hasattr(layer, "disable_adapters")]

    def reference_call(model: Any) -> bool:
        # with peft the reference is the policy under ``disable_adapter()``
        return model is trainer.ref_model or (bool(adapted) and all(layer.disable_adapters for layer in adapted))

    def timed_logps(model: Any, *args: Any, **kwargs: Any) -> Any:
        if not reference_call(model):
            return original_logps(model, *args, **kwargs)
        sync()
        t0 = time.perf_counter()
        out = original_logps(model, *args, **kwargs)
        sync()
        reference_s.append(time.perf_counter() - t0)
        return out

    trainer._get_per_token_logps_and_entropies = timed_logps
    built = time.perf_counter()
    try:
        trainer.train()
    finally:
        finished = time.perf_counter()
        shutil.rmtree(output_dir, ignore_errors=True)

    expected = [prompts[i : i + job["prompts_per_step"]] for i in range(0, len(prompts), job["prompts_per_step"])]
    seen = [call["prompts"] for call in per_call]
    settings = {
        "eos_token_ids": list(trainer.eos_token_ids),
        "pad_token_id": trainer._tokenizer.pad_token_id,
        "tokenizer_eos_token_id": tokenizer.eos_token_id,
        "generation_config": {
            k: getattr(trainer.generation_config, k, None)
            for k in ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "eos_token_id", "pad_token_id")
        },
        "loss_type": trainer.loss_type,
        "beta": trainer.beta,
        "has_ref_model": trainer.ref_model is not None,
        "scale_rewards": trainer.scale_rewards,
        "use_bias_correction_kl": trainer.args.use_bias_correction_kl,
        "epsilon_low_high": [trainer.epsilon_low, trainer.epsilon_high],
        "optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer).__name__,
        "optimizer_defaults": {
            k: (list(v) if isinstance(v, tuple) else v)
            for k, v in trainer.optimizer.param_groups[0].items()
            if k in ("lr", "betas", "eps", "weight_decay", "foreach", "fused")
        },
        "lr_scheduler": type(trainer.lr_scheduler).__name__,
        "model_dtype": str(trainer.model.dtype),
        "gradient_checkpointing": bool(getattr(trainer.model, "is_gradient_checkpointing", False)),
        "per_device_train_batch_size": trainer.args.per_device_train_batch_size,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "cache_implementation": getattr(trainer.args, "cache_implementation", None),
        "use_liger_kernel": bool(getattr(trainer.args, "use_liger_kernel", False)),
        "torch_threads": torch.get_num_threads(),
        "prompt_order_matches_flowrl": seen == expected[: len(seen)] and len(seen) == job["steps"],
    }
    return {
        "framework": "trl",
        "step_s": [b - a for a, b in zip(clock.begin_s, clock.end_s)],
        # End of one step to the end of the next: adds TRL's logging between steps.
        "loop_step_s": [b - a for a, b in zip(clock.end_s, clock.end_s[1:])],
        "reward_mean": [call["reward_mean"] for call in per_call],
        "completion_tokens": [call["completion_tokens"] for call in per_call],
        "generate_s": generate_s,
        "reference_s": reference_s,
        "startup_s": (clock.begin_s[0] if clock.begin_s else finished) - started,
        "trainer_init_s": built - started,
        "first_step_start_unix": clock.first_step_start_unix,
        "shutdown_s": finished - (clock.end_s[-1] if clock.end_s else finished),
        "total_s": finished - started,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,  # KiB on Linux
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
        "logs": clock.logs,
        "settings": settings,
    }


def main() -> None:
    job = json.loads(sys.argv[1])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result = run_trl(job)
    Path(sys.argv[2]).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
