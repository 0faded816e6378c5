"""Files and batches, shared by both APIs' batch endpoints: the blob store, file metadata,
batch records and the runner that serves their lines."""
