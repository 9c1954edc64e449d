"""The OpenAI-compatible Batch API server (``batchline api``): OpenAI's Files and Batches endpoints over batchline
runs, with all its state in topics, so any number of replicas answer alike.

- ``settings``: models -> jobs, tenants' keys, the API's topics; ``records``: what it writes to them;
  ``store``: views of compacted topics and the writer; ``jobs``: each routed job's runs and ledger counts.
- ``files``: uploads as chunks on a topic; ``validate``: input files checked line by line and turned into Requests;
  ``batches``: create, read, cancel, output files; ``objects``: the OpenAI objects and a batch's status.
- ``service``: one replica's state; ``app``: the HTTP endpoints; ``server``: runs it.
"""

from batchline.api.app import create_app
from batchline.api.service import ApiService
from batchline.api.settings import ApiTopics, ModelRoute, load_keys

__all__ = ["ApiService", "ApiTopics", "ModelRoute", "create_app", "load_keys"]
