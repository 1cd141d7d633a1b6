"""The machine code of a compiled kernel, read without a GPU: disassembly and one check of Hopper's wgmma in it.

A ``wgmma.mma_async`` writes its accumulator registers while the warpgroup runs on; the registers may be read
only after a ``wgmma.wait_group`` has retired the group (SASS: ``HGMMA`` ... ``WARPGROUP.DEPBAR.LE gsb0, n``).
The PTX can be right and the assembler's machine code not: :func:`unread_accumulators` lists each group whose
result the code never reads before a later group overwrites the same registers from zero (``RZ, !UPT``), a sum
whose terms were dropped. It reads the listing in order (straight-line code; a loop's back edge is not followed),
which is how the per-step products of the 3xTF32 kernels lie: unrolled runs of k-steps.

``disassemble`` runs ``nvdisasm`` (on the PATH, or from the ``nvidia-cuda-nvdisasm`` wheel of the test extra).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import tempfile


def nvdisasm_path() -> str | None:
    """``nvdisasm`` on the PATH, or the one of the ``nvidia-cuda-nvdisasm`` wheel (nvidia/cu*/bin), or None."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for sub in sorted(os.listdir(root), reverse=True):
            candidate = os.path.join(root, sub, "bin", "nvdisasm")
            if os.access(candidate, os.X_OK):
                return candidate
    return None


def disassemble(cubin: bytes) -> str:
    """The SASS listing of a cubin (``nvdisasm -c``: its code sections)."""
    tool = nvdisasm_path()
    if tool is None:
        raise RuntimeError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (the test extra has it)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True, check=True).stdout


_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_HGMMA = re.compile(r"HGMMA\.64x(\d+)x\d+\.\w+(?:\.\w+)*\s+(RZ|R(\d+)),")  # (F32.TF32, F32, F32.BF16 ...)


def unread_accumulators(sass: str) -> list[str]:
    """One line per wgmma group whose accumulator registers (64 x N float32: N / 2 a thread, from the HGMMA's
    first register) are not all read between the group's retirement and the next group that starts the same
    registers from zero: the registers never read, and where. A group is the HGMMAs up to one marked ``gsb0``
    (its commit); an HGMMA that accumulates onto registers reads them."""
    pending, retired, found = [], [], []
    start, regs = None, set()  # the group being issued: its first HGMMA's address, its registers
    for addr, text in _INSTRUCTION.findall(sass):
        if text.startswith("HGMMA"):
            m = _HGMMA.match(text)
            if m is None:
                raise ValueError(f"an HGMMA of a form not read here: {text}")
            if m.group(2) == "RZ":  # (one the assembler adds, writing no register: still a group the waits count)
                these = set()
            elif ".F32" in text.split()[0]:
                these = set(range(int(m.group(3)), int(m.group(3)) + int(m.group(1)) // 2))
            else:
                raise ValueError(f"an HGMMA with a half-precision accumulator, not read here: {text}")
            for old in [r for r in retired if r[1] & these]:
                if "RZ, !UPT" in text and old[2] & these:  # from zero: what it overwrites must have been read
                    found.append(f"the group at {old[0]}: R{sorted(old[2] & these)} never read before the group "
                                 f"at {addr} overwrote them")
                old[2].difference_update(these)  # (read by an accumulating HGMMA, or reported)
                if not old[2]:
                    retired.remove(old)
            start, regs = start or addr, regs | these
            if "gsb0" in text:  # the group's last instruction
                pending.append((start, regs))
                start, regs = None, set()
        elif text.startswith("WARPGROUP.DEPBAR"):
            left = int(re.search(r"0x([0-9a-f]+)", text).group(1), 16)
            while len(pending) > left:
                first, group = pending.pop(0)
                if group:
                    retired.append((first, group, set(group)))
        elif not text.startswith("WARPGROUP") and " " in text:
            operands = text.split(" ", 1)[1]
            sources = operands.split(",", 1)[1] if "," in operands else operands
            read = {int(r) for r in re.findall(r"\bR(\d+)\b", sources)}
            for old in retired:
                old[2].difference_update(read)
    return found
