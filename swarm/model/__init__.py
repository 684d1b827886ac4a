"""What is trained, and how, the same in every role: the architectures cut into layers
(`transformer`), the update rule (`optim`), the data (`data`, `prepare`), the single-process
reference (`reference`), the stage-state and checkpoint formats (`stage_state`, `checkpoint`),
Hugging Face interchange (`hf`) and sampling (`generate`)."""
