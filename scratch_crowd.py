import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, "bench")
import workloads as w

out = Path(os.environ["OUT"])
tr = Path("/tmp/trace")
w.TRACE = tr
tr.mkdir(exist_ok=True)
c = w.CROWDS["compiled,loader,cpu,item"]
w.CROWDS = {"a": c, "b": c}
res = w.section_crowd(float(sys.argv[1]))
for f in sorted(tr.iterdir(), key=lambda f: f.stat().st_size)[-2:]:
    shutil.copy(f, out / f.name)
