"""Reading part of a chunk: only the blosc blocks that hold the wanted levels (or variables).

ARCO-ERA5 and WeatherBench2 keep all 37 levels of a variable in one chunk; a model trains on
13. A blosc 1 frame is compressed block by block, so only the blocks holding the wanted bytes
need decoding, and on an object store only the header, the block offsets and those blocks
need fetching. ``ranges`` turns wanted indices along axis 1 into byte ranges of a decoded
chunk, ``blocks`` those into blocks and compressed byte ranges (or says why the whole frame is
read instead), ``sparse`` holds the parts of a frame that were fetched, ``decode`` decodes the
needed blocks with c-blosc2, and ``fetch`` fetches them from an object store, deciding per
array whether the second round trip pays. ``StripeReader(part=...)`` is the entry point.
"""
