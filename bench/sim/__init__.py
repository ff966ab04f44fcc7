"""Scale simulation: scripted workers with a real BlockManager and a modelled GPU, many per
process (fleet), driven by ``pdserve bench serve`` through real router processes."""
