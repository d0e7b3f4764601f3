export PYTHONPATH=. ; timeout 70 python3 -m pytest -q -m gpu tests/test_grouped_matmul.py 2>&1 | grep -E "Error|FAILED|passed|failed" | cut -c1-250 | head -8
