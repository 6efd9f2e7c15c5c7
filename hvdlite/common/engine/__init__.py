"""The background thread: negotiation over a transport, the coordinator, join, stall
inspection, fusion, handles."""
