"""Process-wide switches.

``poison_outputs``: fill every output buffer with NaN before a kernel writes it, so that an element a kernel
forgets to write cannot pass a test. The test suite turns it on; it costs one memset per output.
"""

poison_outputs = False
