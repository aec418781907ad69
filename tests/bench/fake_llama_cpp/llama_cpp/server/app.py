"""What bench peers imports to tell that the server extras are installed."""
