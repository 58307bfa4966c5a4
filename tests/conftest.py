"""Eight fake CPU devices, set before JAX initialises; numpy-style rank promotion is an error in tests."""

from shardkit.testing import use_test_devices

use_test_devices(8)
