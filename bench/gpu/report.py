"""What ``run.py`` prints: the dry run (every file a GPU run would send, with its size, the total
against the 64 MiB a run may carry, and the command), and the table of the results. Standard
library only."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

#: The most a run on the GPU machine may carry: the working tree and the carried wheels together.
LIMIT_BYTES = 64 * 2**20
#: The ignored folders a GPU run carries (the wheels, from fetch_wheels.sh).
CARRY = [".whl"]
#: The figures the table shows of a check, in this order, when it has them.
HEADLINES = [
    "rel_error_token-mean", "rel_error_seq-mean-token-mean", "self_logp_diff_max", "bf16_logp_diff_mean",
    "bf16_logp_diff_max", "cpu_resume_bit_exact", "checkpoint_step", "bit_exact", "root_tensors_unchanged",
    "same_tokens", "rel_error_vs_unsharded", "update_rel_error_vs_unsharded", "tokens_per_s", "median_seconds",
    "mfu", "peak_allocated_gib", "peak_rss_gib", "step_seconds", "generate_seconds", "train_seconds",
    "load_seconds", "parameters", "trl", "bytes_ratio", "adapter_bytes", "merged_bytes", "elements_sent",
    "delta_bytes", "full_bytes", "bitwise_equal", "weight_bytes_ratio", "peak_ratio", "step_time_ratio",
    "record_overhead", "replay_overhead_padded", "mismatch_tokens_padded", "logp_diff_live_mean_padded",
    "logp_diff_replayed_mean_padded",
]


# --------------------------------------------------------------------------- the dry run
def sent_files(root: Path) -> dict[str, int]:
    """Every file a run on the GPU machine receives, with its size: what git tracks or would
    (untracked, not ignored), ``shared/`` if the checkout has one, and the carried folders."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode()
    names = {name for name in listed.split("\0") if name}
    for folder in ["shared", *CARRY]:
        if (root / folder).is_dir():
            names.update(str(p.relative_to(root)) for p in (root / folder).rglob("*") if p.is_file())
    sizes = {}
    for name in sorted(names):
        path = root / name
        if path.is_file() and not path.is_symlink():
            sizes[name] = path.stat().st_size
    return sizes


def missing_wheels(root: Path, here: Path) -> list[str]:
    """Requirements of ``wheels.txt`` with no matching wheel in ``.whl/``."""
    have = set()
    for wheel in (root / ".whl").glob("*.whl") if (root / ".whl").is_dir() else []:
        name, version = wheel.name.split("-")[:2]
        have.add((_normal(name), version))
    wanted = [line.strip() for line in (here / "wheels.txt").read_text().splitlines()
              if line.strip() and not line.lstrip().startswith("#")]
    return [req for req in wanted if tuple(_split(req)) not in have]


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _split(requirement: str) -> tuple[str, str]:
    name, version = requirement.split("==")
    return _normal(name), version


def print_dry_run(args: Any, root: Path, here: Path, command: str, timeout_s: int) -> int:
    sizes = sent_files(root)
    total = sum(sizes.values())
    if not args.quiet:
        print("files a GPU run sends (bytes, path):")
        for name, size in sizes.items():
            print(f"{size:>12,}  {name}")
    by_top: dict[str, int] = {}
    for name, size in sizes.items():
        top = name.split("/")[0] if "/" in name else "(root files)"
        by_top[top] = by_top.get(top, 0) + size
    print("by folder:")
    for top, size in sorted(by_top.items(), key=lambda kv: -kv[1]):
        print(f"{size:>12,}  {top}")
    wheels = sum(size for name, size in sizes.items() if name.startswith(".whl/"))
    print(f"total: {len(sizes)} files, {total:,} bytes ({total / 2**20:.2f} MiB; the wheels {wheels / 2**20:.2f} MiB)"
          f" of the {LIMIT_BYTES // 2**20} MiB a run may carry: {'fits' if total <= LIMIT_BYTES else 'TOO LARGE'}")
    missing = missing_wheels(root, here)
    if missing:
        print(f"missing wheels (run bash bench/gpu/fetch_wheels.sh first): {', '.join(missing)}")
    print("the run, as the device tool's call:")
    print(f"  carry: {CARRY}")
    print(f"  timeout_s: {timeout_s}")
    print(f"  command: {command}")
    return 0 if total <= LIMIT_BYTES else 1


# --------------------------------------------------------------------------- the table
def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int) and value >= 10_000:
        return f"{value:,}"
    return str(value)


def rows(summary: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """``(part, check, status, seconds, figures)`` for every check of every part."""
    out = []
    for part, record in summary["parts"].items():
        checks = record.get("checks") or {}
        why = record.get("reason") or record.get("error") or ""
        if not checks or record.get("status") in ("skipped", "timeout", "crashed"):
            out.append((part, "-", record.get("status", "?"), _fmt(record.get("seconds", "")), why[:160]))
        for name, check in checks.items():
            figures = [f"{k}={_fmt(check[k])}" for k in HEADLINES if check.get(k) is not None]
            if check.get("status") in ("error", "skipped"):
                figures = [(check.get("error") or check.get("reason") or "")[:160]]
            out.append((part, name, check.get("status", "?"), _fmt(check.get("seconds", "")), ", ".join(figures)))
        for mode in ("packed", "packed_segments"):
            for name, cmp in (record.get(f"padded_vs_{mode}") or {}).items():
                out.append((part, f"padded_vs_{mode}_{name}", "-", "",
                            ", ".join(f"{k}={_fmt(v)}" for k, v in cmp.items())))
        if part == "throughput" and record.get("packing"):
            out.append((part, "packing", "-", "", str(record["packing"])))
    return out


def table_markdown(summary: dict[str, Any]) -> str:
    env = summary.get("environment", {})
    head = (f"GPU check, {summary['started']}: {env.get('gpu') or env.get('device')}, torch "
            f"{(env.get('versions') or {}).get('torch')}, {summary['seconds']} s of {summary['budget_s']:.0f}; "
            f"overall: {summary['status']}\n\n")
    lines = ["| part | check | status | s | figures |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(cell.replace('|', '/') for cell in row)} |" for row in rows(summary)]
    return head + "\n".join(lines) + "\n"


def print_table(summary: dict[str, Any]) -> None:
    table = rows(summary)
    widths = [max(len(r[i]) for r in [("part", "check", "status", "s", "figures"), *table]) for i in range(4)]
    print()
    for row in [("part", "check", "status", "s", "figures"), *table]:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:4], widths)) + "  " + row[4])
    print(flush=True)
