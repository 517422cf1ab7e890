"""Where the engine's executor thread spends its samples, from `py-spy record -f raw` output
(several processes' files concatenated, each after a line '=== <file>'):
python3 py_spy_executor.py py_spy_callN.txt.gz"""

import collections
import gzip
import sys


def frame_name(frame: str) -> str:
    """'fn (path/to/file.py:12)' -> 'fn (file.py:12)'."""
    return frame.split(" (")[0] + " (" + frame.split("/")[-1] if "/" in frame else frame


def main(path: str) -> None:
    stacks = collections.defaultdict(list)
    section = None
    for line in gzip.open(path, "rt"):
        line = line.rstrip("\n")
        if line.startswith("==="):
            section = line.split()[1]
        elif line.strip():
            stack, count = line.rsplit(" ", 1)
            stacks[section].append((stack.split(";"), int(count)))
    for section, rows in stacks.items():
        executor = [(s, n) for s, n in rows if any("Executor._work" in f for f in s)]
        if not executor:
            continue
        total = sum(n for _, n in executor)
        print("=====", section, "executor samples", total)
        own, inclusive = collections.Counter(), collections.Counter()
        for stack, n in executor:
            names = [frame_name(f) for f in stack]
            own[names[-1]] += n
            for name in set(names):
                inclusive[name] += n
        for name, n in own.most_common(20):
            print(f" self {100 * n / total:5.1f}% {name}")
        for name, n in inclusive.most_common(45):
            print(f" incl {100 * n / total:5.1f}% {name}")


if __name__ == "__main__":
    main(sys.argv[1])
