"""Model backends: megatron/ (GPTModel from a HF config, HF<->Megatron weights, fused LM head, the
train/forward engine) and hf.py (plain transformers models). Nothing here knows about Ray or rollouts.
"""
