{{- /*
The endpoint picker's configuration (llm-d-router's EndpointPickerConfig, v0.10): scrape each pod's
/metrics on the metrics port rather than the pool's port, read Tandem's names for what the model
server protocol asks (docs/telemetry.md, "What the inference gateway reads"; tests check them against
a real server's /metrics), and score pods by queue, free KV cache and prefix locality with the
weights of the picker's own default profile. Tandem serves no LoRA adapters: no LoRA metric.
*/}}
{{- define "tandem.endpointPickerConfig" -}}
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: metrics-data-source
    parameters:
      scheme: http
      path: /metrics
      port: {{ .metricsPort }}
  - type: core-metrics-extractor
    parameters:
      defaultEngine: tandem
      engineConfigs:
        - name: tandem
          queuedRequestsSpec: tandem_requests_waiting
          runningRequestsSpec: tandem_requests_running
          kvUsageSpec: tandem_kv_cache_usage_ratio
          loraSpec: ""
          cacheInfoSpec: tandem_cache_config_info
  - type: queue-scorer
  - type: kv-cache-utilization-scorer
  - type: prefix-cache-scorer
dataLayer:
  sources:
    - pluginRef: metrics-data-source
      extractors:
        - pluginRef: core-metrics-extractor
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: prefix-cache-scorer
        weight: 3
{{- end -}}
