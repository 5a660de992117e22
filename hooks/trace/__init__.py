"""The hand-written-attention tracer's files, in the order they run: the recorded calls of one module call
(``recorder``), the torch ops it follows (``ops``), back from the softmax to q and k (``chain``), one softmax
read into a record (``read``) and the mistakes seen on the way (``mistakes``)."""
