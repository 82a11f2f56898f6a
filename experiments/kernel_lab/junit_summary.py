"""Summary of a pytest junit XML (the GPU machine loses pytest's own summary line): counts, then
each failed or errored test with the first lines of its message.
Usage: python3 -m experiments.kernel_lab.junit_summary $OUT/junit.xml"""
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suite = root[0] if root.tag == "testsuites" else root
print({k: suite.get(k) for k in ("tests", "failures", "errors", "skipped", "time")})
for case in suite.iter("testcase"):
  for bad in list(case.findall("failure")) + list(case.findall("error")):
    msg = (bad.get("message") or bad.text or "").strip().splitlines()
    print(f"{bad.tag.upper()} {case.get('name')}: {' | '.join(msg[:6])[:600]}")
