"""DeepSeek-V2/V3 models, their layers and the checkpoint loader."""
