"""The weight store: content-addressed blobs and manifests (`store`), a local model imported
(`importing`), sealed at rest (`sealed`, `unseal`), re-verified (`verify`), converted (`convert`)."""
