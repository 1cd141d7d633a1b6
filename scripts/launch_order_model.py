"""A model of when a causal launch ends, for the order in which the blocks take their tiles
(``kernels/common.make_launch_order``): blocks start in launch order on whichever SM is free first (one block an
SM at a time, as the Hopper forward's 384 threads of 168 registers fill one), and a query tile's block costs its key
tiles (tile x from the end of nq sees nq - x) plus a fixed start and end of ``--overhead`` tiles. Each line: SMs,
query tiles a head (nq), heads (batch x heads), the groups' heads g, and the last block's end over the work
shared evenly, for the heads one after another (each longest first) and for the groups (no GPU needed):

    python scripts/launch_order_model.py [--sms 132 108 40] [--overhead 1.0]
"""

import argparse
import heapq
import math

from flashnumba.kernels.common import GROUP_BLOCKS


def end(costs, sms):
    """When the last block ends: each starts, in order, on the SM that is free first."""
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sms", type=int, nargs="+", default=[132, 108, 40])
    ap.add_argument("--overhead", type=float, default=1.0)
    args = ap.parse_args()
    shapes = ((32, 128), (32, 64), (64, 64), (128, 32), (16, 256), (8, 512), (32, 16), (128, 4))
    print("SMs  nq  heads    g  heads one after another  groups")
    for sms in args.sms:
        for nq, heads in shapes:
            cost = [nq - x + args.overhead for x in range(nq)]  # from the end: the longest first
            g = math.ceil(GROUP_BLOCKS / nq)
            by_head = [c for _ in range(heads) for c in cost]
            by_group = [c for first in range(0, heads, g)
                        for c in cost for _ in range(min(g, heads - first))]
            even = sum(by_head) / sms
            one, grouped = end(by_head, sms) / even, end(by_group, sms) / even
            print(f"{sms:3d} {nq:4d} {heads:6d} {g:4d}  {one:23.3f}  {grouped:6.3f}")


if __name__ == "__main__":
    main()
