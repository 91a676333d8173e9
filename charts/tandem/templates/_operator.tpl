{{/*
How the chart starts `tandem operator`: its arguments, settings and liveness endpoint.
Kept in one place; they follow docs/operator.md ("Running it").
*/}}

{{- define "tandem.operatorHealthPort" -}}8080{{- end -}}
{{- define "tandem.operatorHealthPath" -}}/healthz{{- end -}}

{{/*
kopf pauses every replica whose peering priority equals another's, so standby replicas each draw
a random priority at start (what kopf's docs advise); the highest one acts.
*/}}
{{- define "tandem.operatorCommand" -}}
{{- if and (gt (int .Values.operator.replicas) 1) .Values.peering.create -}}
command: [/bin/sh, -c]
args:
  - export TANDEM_OPERATOR_PRIORITY="$(od -An -N2 -tu2 /dev/urandom | tr -d ' ')"; exec tandem operator
{{- else -}}
args: [operator]
{{- end -}}
{{- end -}}

{{- define "tandem.operatorEnv" -}}
- name: TANDEM_OPERATOR_NAMESPACES
  value: {{ join "," .Values.operator.watchNamespaces | quote }}
- name: TANDEM_OPERATOR_PEERING
  value: {{ ternary .Values.peering.name "" .Values.peering.create | quote }}
- name: TANDEM_OPERATOR_LIVENESS_PORT
  value: {{ include "tandem.operatorHealthPort" . | quote }}
- name: TANDEM_OPERATOR_LOG_LEVEL
  value: {{ .Values.operator.logLevel | quote }}
{{- end -}}
