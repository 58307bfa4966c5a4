"""What is predicted: the analytic memory, communication and FLOPs of a layout, and its step time from kernel and
collective costs."""
