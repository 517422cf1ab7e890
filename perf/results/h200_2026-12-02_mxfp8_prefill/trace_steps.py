import gzip, re, sys
from datetime import datetime
pat = re.compile(r"^(\S+ \S+) .*trace: step (\d+) (\w+) batch=(\d+) tokens=(\d+)(?: load-back=\d+ pages)? host=([\d.]+)ms \(plan ([\d.]+) \+ process ([\d.]+)\) run=([\d.]+)ms")
rows = []
for line in gzip.open(sys.argv[1], "rt"):
    m = pat.search(line)
    if m:
        t = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        rows.append((t, int(m[2]), m[3], int(m[4]), int(m[5]), float(m[6]), float(m[7]), float(m[8]), float(m[9])))
print(len(rows), "steps")
import collections
by = collections.defaultdict(list)
for r in rows: by[r[2]].append(r)
for k, v in by.items():
    runs = sorted(r[8] for r in v); hosts = sorted(r[5] for r in v)
    print(k, len(v), "run p50 %.2f p99 %.2f max %.2f" % (runs[len(runs)//2], runs[int(len(runs)*.99)], runs[-1]), "host p50 %.2f p99 %.2f max %.2f" % (hosts[len(hosts)//2], hosts[int(len(hosts)*.99)], hosts[-1]))
# gaps between successive step log lines
gaps = [(rows[i][0] - rows[i-1][0]) * 1e3 for i in range(1, len(rows))]
big = sorted(range(1, len(rows)), key=lambda i: -gaps[i-1])[:25]
for i in sorted(big):
    r = rows[i]
    print("gap %.1f ms before step %d %s batch=%d tokens=%d host=%.2f run=%.2f | prev %s b=%d tok=%d run=%.2f" % (gaps[i-1], r[1], r[2], r[3], r[4], r[5], r[8], rows[i-1][2], rows[i-1][3], rows[i-1][4], rows[i-1][8]))
print()
def pct(v, q): v = sorted(v); return v[min(len(v)-1, int(len(v)*q))]
for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 256)):
    g = [gaps[i-1] for i in range(1, len(rows)) if lo <= rows[i][3] <= hi and gaps[i-1] < 1000]
    runs = [rows[i][8] for i in range(1, len(rows)) if lo <= rows[i][3] <= hi]
    mixed = sum(1 for i in range(len(rows)) if lo <= rows[i][3] <= hi and rows[i][2] == "mixed")
    if g: print(f"batch {lo}-{hi}: {len(g)} steps ({mixed} mixed), log gap p50 {pct(g,.5):.1f} p90 {pct(g,.9):.1f} p99 {pct(g,.99):.1f}; run p50 {pct(runs,.5):.2f} p99 {pct(runs,.99):.2f}")
