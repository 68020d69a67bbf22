{{/* Labels every object of the release carries. */}}
{{- define "stratamq.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator's name: its ServiceAccount, ClusterRole(Binding), Deployment and
     peering object are all called this. */}}
{{- define "stratamq.operatorName" -}}
{{ .Release.Name }}-stratamq-operator
{{- end -}}

{{/* The ClusterRole the operator binds each storage's Spark driver account to. */}}
{{- define "stratamq.sparkDriverRole" -}}
{{ .Release.Name }}-stratamq-spark
{{- end -}}

{{- define "stratamq.operatorSelector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The PriorityClass of the operator's pods: the values' name, else the chart's own. */}}
{{- define "stratamq.operatorPriorityClass" -}}
{{- if .Values.operator.priorityClassName -}}
{{ .Values.operator.priorityClassName }}
{{- else if .Values.operator.priorityClass.create -}}
{{ include "stratamq.operatorName" . }}
{{- end -}}
{{- end -}}
