"""GGUF models: read (reader.py, header.py), mapped onto Hugging Face names and configs (archs.py,
names.py, tokenizer.py), and served kept in their blocks (assemble.py, linear.py, dequant.py) or
dequantized (load.py, convert.py)."""
