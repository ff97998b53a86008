"""What a log line says beyond the loss: rates per device and MFU (:class:`Rates`), peak memory
(:func:`peak_memory`), the line itself (:func:`format_line`), and the block of every effective
setting printed at the top of a run's log (:func:`config_block`).

Example::

    rates = Rates(devices=2, flops_per_token=flops_per_token(config, seq_len=128), peak_flops_per_s=None)
    row = {"step": 1, "loss": 5.5, "lr": 1e-4, "grad_norm": 2.0, **rates.fields(tokens_per_s=8000.0),
           **peak_memory(torch.device("cpu")), "elapsed_s": 3.0, "eta_s": 60.0}
    print(format_line(row, total_steps=600))
"""

from __future__ import annotations

import dataclasses
import datetime
import sys

from .toml_text import toml_setting


@dataclasses.dataclass(frozen=True)
class Rates:
    """A world's tokens/s as per-device rates: ``devices`` ranks share the tokens and the FLOPs
    (TP ranks split each token's work, DP ranks split the tokens); ``peak_flops_per_s`` None
    (a CPU, an unknown device) leaves MFU out."""

    devices: int
    flops_per_token: int
    peak_flops_per_s: float | None

    def fields(self, *, tokens_per_s: float) -> dict:
        per_device = tokens_per_s / self.devices
        flops = per_device * self.flops_per_token
        row = {"tokens_per_s_per_device": _significant(per_device), "tflops_per_device": _significant(flops / 1e12)}
        if self.peak_flops_per_s:
            row["mfu"] = _significant(flops / self.peak_flops_per_s)
        return row


def _significant(value: float) -> float:
    """``value`` to 6 significant digits: a CPU's TFLOP/s are small numbers."""
    return float(f"{value:.6g}")


def peak_memory(device) -> dict:
    """This process's peak memory so far, in MiB: on a CUDA ``device`` the caching allocator's most
    allocated and most reserved bytes; elsewhere (a CPU, None) the process's peak resident set (RSS)."""
    if device is not None and device.type == "cuda":
        import torch

        return {"max_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
                "max_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20, 1)}
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"max_rss_mib": round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)}


def _size(mib: float) -> str:
    return f"{mib / 1024:,.2f} GiB" if mib >= 1024 else f"{mib:,.1f} MiB"


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


def format_line(row: dict, *, total_steps: int) -> str:
    """One logged step as a line: ``step 10/600 loss 4.8123 lr 3.00e-03 grad norm 0.912 | ...``."""
    parts = [f"step {row['step']}/{total_steps} loss {row['loss']:.4f} lr {row['lr']:.2e} "
             f"grad norm {row['grad_norm']:.3f}"]
    if "moe_imbalance" in row:
        parts.append(f"experts: aux loss {row['moe_aux_loss']:.4g}, load max/mean {row['moe_imbalance']:.2f}")
    if "tokens_per_s_per_device" in row:
        rate = f"{row['tokens_per_s_per_device']:,.0f} tokens/s/device, {row['tflops_per_device']:.3g} TFLOP/s/device"
        parts.append(rate + (f", MFU {100 * row['mfu']:.1f}%" if "mfu" in row else ""))
    if "max_allocated_mib" in row:
        parts.append(f"memory {_size(row['max_allocated_mib'])} max allocated, {_size(row['max_reserved_mib'])} "
                     "max reserved")
    elif "max_rss_mib" in row:
        parts.append(f"memory {_size(row['max_rss_mib'])} peak RSS")
    eta = f", ETA {_duration(row['eta_s'])}" if "eta_s" in row else ""
    parts.append(f"elapsed {_duration(row['elapsed_s'])}{eta}")
    return " | ".join(parts)


def config_block(sections: dict[str, dict]) -> str:
    """``sections`` ({table: {setting: value}}) as TOML, one ``[table]`` each; a setting that is
    None (not set: e.g. no ``--data``, the embedded corpus) is a comment, TOML having no null."""
    lines = []
    for table, settings in sections.items():
        lines.append(f"[{table}]")
        lines.extend(f"# {name}: not set" if value is None else toml_setting(name, value)
                     for name, value in settings.items())
    return "\n".join(lines)
