"""Framework-neutral core of hvdlite: engine, negotiation, fusion, backends, numpy API."""
