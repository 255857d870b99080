"""Part j: FP8 (train.fp8: deepseek) on the GPU: the backend's blockwise FP8 GEMM (torch._scaled_mm,
1x128 x 128x128) against a bfloat16 matmul at DeepSeek-V3's shapes, TFLOP/s by the device's timer
(anchors, docs/fp8.md: torch's blockwise _scaled_mm 1,009 against bfloat16 608 on an H100, DeepGEMM
up to 1,426 on an H800, the FP8 peak 1,979); and the GPU's FP8 matmul against the emulation (the
conformance kit's bounds: SQNR >= 40 dB, calc_diff < 1e-4), dense and over 200 tokens (the weight
gradient's 1x128 x 128x1 form). Which path ran (blockwise or the emulation, and why) is recorded.

Then the training step of part e's architecture with ``train.fp8: deepseek`` against the same step
in bfloat16 (float32 master weights and AdamW on both sides), median step time by the device's
timer, and their ratio. Not part e's model itself: its dense FFN is 10944 wide (DeepSeek-V2-Lite's)
and MLA's compressed keys and values with their RoPE part are kv_lora_rank + qk_rope_head_dim = 576
wide, not multiples of 128, so those Linears would stay in bfloat16 and the ratio would time part
of the recipe. :data:`STEP_MODEL` widens the FFN to 11008 and the RoPE head to 128 (576 -> 640, the
queries 16 x 256), so every Linear runs in FP8 (``kept_linears`` records any that would not), with
one dense and one MoE layer to fit the part's cap."""

from __future__ import annotations

import statistics
from typing import Any

from .common import Ctx, Record, cuda_reason, device_time
from .speed import SPEED_COMMON, SPEED_MODELS, ours_speed, speed_raw

#: (M, K, N): DeepSeek-V3's expert projection over 4,096 tokens and its 7168 x 24576 query up-projection
SHAPES = [(4096, 7168, 2048), (4096, 7168, 24576)]
DRY_SHAPES = [(64, 384, 256)]
#: part e's architecture with every Linear's widths multiples of 128 (see the module docstring)
STEP_MODEL = {**SPEED_MODELS[-1], "ffn_hidden": 11008, "qk_rope_head_dim": 128, "n_layers": 2, "n_experts": 64}
#: the dry mode's: the same architecture at widths of 128 (the CPU's emulation of the recipe)
STEP_DRY = {"hidden": 128, "n_layers": 2, "n_dense": 1, "n_heads": 1, "ffn_hidden": 128, "moe_hidden": 128, "n_experts": 4, "top_k": 2,
            "n_groups": 2, "topk_groups": 1, "q_lora_rank": 0, "kv_lora_rank": 128, "qk_nope_head_dim": 128, "qk_rope_head_dim": 128,
            "v_head_dim": 128, "seq_len": 32, "vocab_size": 256}


def step_raw(fp8: bool, device: str, dry: bool) -> dict[str, Any]:
    """Part e's run (:func:`~.speed.speed_raw`) of :data:`STEP_MODEL`, in bfloat16 with float32 master
    weights, with ``train.fp8`` deepseek or off."""
    raw = speed_raw(STEP_MODEL, device, dry)
    raw["model"] = {**SPEED_COMMON, **STEP_MODEL, **(STEP_DRY if dry else {}), "dtype": "bfloat16"}
    raw["train"]["fp8"] = "deepseek" if fp8 else "off"
    return raw


def fp8_step(device: str, ctx: Ctx) -> dict[str, Any]:
    """The FP8 step against the bfloat16 step of :data:`STEP_MODEL`: each side's median step time
    and tokens/s, the ratio of the step times (FP8 over bfloat16), the Linears FP8 left out."""
    from portapipe.config import config_from_dict
    from portapipe.models.fp8_layers import plan

    eligible, kept = plan(config_from_dict(step_raw(True, device, ctx.dry)).model)
    out: dict[str, Any] = {"model": step_raw(True, device, ctx.dry)["model"], "fp8_linears": len(eligible),
                           "kept_linears": [lin.name for lin in kept]}
    for name, fp8 in (("bfloat16", False), ("fp8", True)):
        got = ours_speed(step_raw(fp8, device, ctx.dry), ctx)
        if "error" in got:
            out["error"] = f"{name}: {got['error']}"
            return out
        out[name] = {"median_step_s": statistics.median(got["step_s"]), "tokens_per_s": got["tokens_per_s"], "steps_timed": got["steps_timed"]}
    out["fp8_over_bfloat16_step_time"] = out["fp8"]["median_step_s"] / out["bfloat16"]["median_step_s"]
    return out


def part_fp8(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.backends import get_backend
    from portapipe.backends.fp8_mm import fp8_mm_emulated
    from portapipe.backends.scaled_mm import KIT_CALC_DIFF, KIT_SQNR_DB, calc_diff, sqnr_db
    from portapipe.fp8.quantize import quantize_blocks, quantize_rows

    reason = cuda_reason()
    device = "cuda" if reason is None and not ctx.dry else "cpu"
    be = get_backend(device)
    rec.put("path", be.fp8_path())
    dev = be.device()
    rows, agree = [], []
    for m, k, n in DRY_SHAPES if ctx.dry else SHAPES:
        g = torch.Generator().manual_seed(m + k + n)
        x = torch.randn(m, k, generator=g).to(dev, torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dev, torch.bfloat16)
        xq, wq = quantize_rows(x), quantize_blocks(w)
        wt = wq.data.t(), wq.scale.t()
        reps = 2 if ctx.dry else 20
        fp8_s = device_time(be, lambda: be.fp8_mm(xq.data, xq.scale, wt[0], wt[1], torch.bfloat16), reps)
        bf16_s = device_time(be, lambda: x @ w.t(), reps)
        flops = 2.0 * m * k * n
        rows.append({"m": m, "k": k, "n": n, "fp8_s": fp8_s, "bf16_s": bf16_s, "fp8_tflops": flops / fp8_s / 1e12,
                     "bf16_tflops": flops / bf16_s / 1e12, "fp8_over_bf16": bf16_s / fp8_s})
        rec.put("gemm", rows)
        # against the emulation on 256 rows (the float64 block sums of the whole would take minutes)
        r = slice(0, min(m, 256))
        got = be.fp8_mm(xq.data[r], xq.scale[r], wt[0], wt[1], torch.float32).cpu()
        want = fp8_mm_emulated(xq.data[r].cpu(), xq.scale[r].cpu(), wt[0].cpu(), wt[1].cpu(), torch.float32)
        agree.append({"form": f"1x128 x 128x128, {min(m, 256)} x {k} x {n}", "sqnr_db": sqnr_db(got, want), "calc_diff": calc_diff(got, want)})
        # the weight gradient's form: 1x128 x 128x1 over 200 tokens (padded to 256 for the kernel)
        gt, xt = quantize_rows(x[:200, :256].t()), quantize_rows(x[:200, 256:512].t())
        got = be.fp8_mm(gt.data, gt.scale, xt.data.t(), xt.scale.t(), torch.float32).cpu()
        want = fp8_mm_emulated(gt.data.cpu(), gt.scale.cpu(), xt.data.t().cpu(), xt.scale.t().cpu(), torch.float32)
        form = f"1x128 x 128x1, {gt.data.shape[0]} x {gt.data.shape[1]} x {xt.data.shape[0]}"
        agree.append({"form": form, "sqnr_db": sqnr_db(got, want), "calc_diff": calc_diff(got, want)})
        rec.put("against_emulation", agree)
        if ctx.left() < 10:
            break
    within = all(a["sqnr_db"] >= KIT_SQNR_DB and a["calc_diff"] < KIT_CALC_DIFF for a in agree)
    rec.put("within_kit_bounds", within)
    step = fp8_step(device, ctx)
    rec.put("step", step)
    step_line = (f"step {step['error'][:120]}" if "error" in step else
                 f"step FP8 {step['fp8']['median_step_s']:.3g} s vs bf16 {step['bfloat16']['median_step_s']:.3g} s "
                 f"({step['fp8_over_bfloat16_step_time']:.2f}x){', kept ' + str(len(step['kept_linears'])) if step['kept_linears'] else ''}; ")
    rec["summary"] = step_line + "; ".join(f"{r['m']}x{r['k']}x{r['n']}: FP8 {r['fp8_tflops']:.0f} vs bf16 {r['bf16_tflops']:.0f} TFLOP/s" for r in rows)[:250] + (
        f"; vs emulation within bounds: {within}")
    good = within and "error" not in step and not step["kept_linears"]
    rec["status"] = ("ok" if good else "failed") if device == "cuda" else ("failed" if "error" in step else "dry" if ctx.dry else "skipped")
    if device == "cpu":
        rec["reason"] = reason or "dry mode"
