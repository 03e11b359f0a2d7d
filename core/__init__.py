"""What every entry point shares, below trainer/ and inference/: checkpoints (find, load, save,
verify), devices and precision, and the user-error boundary. Imports model/ and data/ only."""
