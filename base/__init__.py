"""The ground floor: the user-error boundary, the validators every config object uses, the
Hydra entry decorator and atomic file writes. Imports nothing of ours, so every package above
can use it."""
