"""Process-wide concerns: the garbage collector held off during saves and
restores (gc), and what is waited for at exit (exit)."""
