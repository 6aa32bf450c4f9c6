"""M6-style multimodal transformer (image patches + text, MoE FFNs): config, model, data,
training script. Run `python examples/m6/train.py`."""
