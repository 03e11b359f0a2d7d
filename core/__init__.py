"""What every entry point shares, below trainer/ and inference/: checkpoints (find, load, save,
verify) and devices and precision. Imports base/, model/ and data/ only."""
