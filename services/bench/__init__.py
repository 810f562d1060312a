"""`specserve bench`: Spec-Bench speedups side by side with Hugging Face peers (`spec`), and load
tests of a running gateway (`load`). Each writes JSON, a Markdown table and a PNG chart."""
