"""What is read from the compiled program: its collectives, memory and HLO text, whether its peak fits, timed
collectives."""
