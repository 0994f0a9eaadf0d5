#!/usr/bin/env python3
"""The disk's sequential read bandwidth, and cold page caches, for timing a replay's read.

    disk-bandwidth.py FILE...          read the files once with O_DIRECT (no page cache) in 64 MiB
                                       requests; prints bytes, seconds and GB/s (10^9 bytes/s)
    disk-bandwidth.py --drop FILE...   flush and drop the files' pages from the page cache
                                       (posix_fadvise DONTNEED: no privileges needed)

tools/gpu-cli-test --cold uses both around each timed replay, so that the replay's `read` stage is
set against the bandwidth of the same disk measured in the same call.
"""
import mmap
import os
import sys
import time

REQUEST = 64 << 20


def drop(paths):
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def direct_read(paths):
    buffer = mmap.mmap(-1, REQUEST)  # page-aligned, as O_DIRECT needs
    total = 0
    begin = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            offset = 0
            while True:
                got = os.preadv(fd, [buffer], offset)
                if got <= 0:
                    break
                offset += got
            total += offset
        finally:
            os.close(fd)
    seconds = time.perf_counter() - begin
    return total, seconds


def main(argv):
    if not argv or argv == ["--drop"]:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    if argv[0] == "--drop":
        drop(argv[1:])
        return 0
    total, seconds = direct_read(argv)
    print(f"disk: {total} bytes in {seconds:.4f} s with O_DIRECT = {total / seconds / 1e9:.3f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
