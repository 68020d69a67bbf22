"""What the site's HTTP listeners share (the admin port, the peer port, the cluster
controller's API): nothing of MQTT or of the storage."""
