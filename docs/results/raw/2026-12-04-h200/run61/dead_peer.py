import re, subprocess, sys
src = open("tests/test_symm_scan.py").read()
body = re.search(r'DEAD_PEER = """(.*?)"""', src, re.S).group(1)
for fused in (True, False):
    out = subprocess.run([sys.executable, "-c", body.format(fused=fused)], capture_output=True, text=True, timeout=120)
    text = out.stdout + out.stderr
    lines = [l for l in text.splitlines() if any(w in l.lower() for w in ("error", "trap", "timeout", "fatal", "no error"))]
    print(f"== fused={fused} rc={out.returncode}", *lines[:6], sep="\n")
