"""The main job on a laptop CPU: an instrumented calculator agent that learns its answer format.

``python -m examples.learn_on_cpu train`` trains SmolLM2-135M-Instruct (LoRA, embedded transformers
backend) with LightningRL; ``dev`` prints the transitions a run trains on; ``eval`` measures held-out
reward. See README.md in this directory.
"""
