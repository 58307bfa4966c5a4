"""What `shardkit plan` prints and draws."""
