"""What `shardkit suggest` searches and ranks."""
