"""Where a kernel's warps spend their time, by machine instruction: Nsight Compute's warp-state samples (the
SourceCounters section) read from its source page exported as CSV, grouped into runs of instructions that execute
equally often (a kernel's start, its tile loop, its end, the producer's loop: each runs a different number of
times), with each run's share of all samples, then the instructions that hold the most samples with their three
main stall reasons. On the GPU machine:

    ncu --profile-from-start off --clock-control none -k regex:forward_wgmma --section SourceCounters \\
        --section WarpStateStats -o wg python scripts/wgmma_ncu.py --head-dim=64 --causal 128:128:384
    ncu -i wg.ncu-rep --page source --csv --print-source sass > src.csv

then anywhere: ``python scripts/ncu_source_regions.py src.csv [--top 40] [--min-share 0.3]`` (a .csv.gz too).
"""

import argparse
import csv
import gzip

ALL = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def read(path):
    """(header, rows) of the source page: the first line names the kernel, the second the columns."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        rows = list(csv.reader(f))
    return rows[1], rows[2:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--min-share", type=float, default=0.3, help="runs below this share (%%) are not listed")
    args = ap.parse_args()
    header, rows = read(args.csv)
    col = {h: i for i, h in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    count = lambda r, h: int(r[col[h]] or 0)  # noqa: E731
    total = sum(count(r, ALL) for r in rows)
    print(f"{len(rows)} instructions, {total} warp samples")
    print("\nruns of instructions executed equally often (first - last, times each ran, share of the samples):")
    runs = []
    for n, r in enumerate(rows):
        if runs and runs[-1][2] == count(r, EXECUTED):
            runs[-1][1], runs[-1][3] = n, runs[-1][3] + count(r, ALL)
        else:
            runs.append([n, n, count(r, EXECUTED), count(r, ALL), r[col["Source"]].strip()])
    for first, last, times, samples, text in runs:
        if 100 * samples / total >= args.min_share:
            print(f"  {first:5d} - {last:5d}  {times:>9d}  {100 * samples / total:5.1f}%  from: {text[:60]}")
    print(f"\nthe {args.top} instructions with the most samples (index, share, times executed, three main reasons):")
    ranked = sorted(range(len(rows)), key=lambda n: -count(rows[n], ALL))[:args.top]
    for n in ranked:
        r = rows[n]
        main3 = sorted(((count(r, h), h[len("stall_"):]) for h in reasons), reverse=True)[:3]
        why = ", ".join(f"{name} {k}" for k, name in main3 if k)
        print(f"  {n:5d}  {100 * count(r, ALL) / total:4.1f}%  {count(r, EXECUTED):>9d}  "
              f"{r[col['Source']].strip()[:58]:58s}  {why}")


if __name__ == "__main__":
    main()
