"""The ground floor: the user-error boundary and the validators every config object uses.
Imports nothing of ours, so model/ and data/ can use it as well as everything above them."""
